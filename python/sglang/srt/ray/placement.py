"""Placement plan for ``--use-ray``: roles -> placement-group bundles (pure Python, no ``ray`` import).

A *role group* is one instance of one role (e.g. the TP group of an aggregated server, a prefill instance, a
decode instance, an attention or FFN pool): ``num_workers`` workers split into ``nnodes`` equal node slices.
Each node slice becomes one bundle holding the resources of all its workers, so the workers of a slice share a
node (STRICT_PACK inside a TP group) and the slices of one group land on distinct nodes (STRICT_SPREAD).

``spread_roles=False``: one placement group per role group (``STRICT_PACK`` with one slice, ``STRICT_SPREAD``
with several). ``spread_roles=True``: every slice of every role group in ONE placement group with
``STRICT_SPREAD``, so different roles (prefill vs decode, attention vs FFN) never share a node.

Extra per-group resources (e.g. the detokenizer's CPU) are added to the bundle of slice 0 with ``extra``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence


@dataclass(frozen=True)
class RoleGroup:
    """One instance of a role to place.

    Attributes:
        role: the role name ("scheduler", "prefill", "decode", "attention", "ffn", ...).
        num_workers: workers of this instance (its TP size); ranks ``0 .. num_workers-1``.
        nnodes: node slices the workers are split into (``num_workers % nnodes == 0``).
        resources: what ONE worker reserves, e.g. ``{"CPU": 1, "GPU": 1}`` (Ray resource names).
        extra: resources added to slice 0's bundle for helper processes of the group (e.g. a detokenizer).
    """

    role: str
    num_workers: int
    nnodes: int = 1
    resources: Mapping[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    extra: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"role group {self.role!r}: num_workers={self.num_workers} must be >= 1")
        if self.nnodes < 1 or self.num_workers % self.nnodes:
            raise ValueError(f"role group {self.role!r}: nnodes={self.nnodes} must divide num_workers="
                             f"{self.num_workers} (every node slice holds the same number of workers)")
        for k, v in {**self.resources, **self.extra}.items():
            if v < 0:
                raise ValueError(f"role group {self.role!r}: resource {k}={v} must be >= 0")

    @property
    def per_node(self) -> int:
        """Workers in each node slice."""
        return self.num_workers // self.nnodes

    def slice_of(self, rank: int) -> int:
        """The node slice of worker ``rank`` (ranks are laid out slice by slice)."""
        if not 0 <= rank < self.num_workers:
            raise ValueError(f"role group {self.role!r}: rank {rank} not in [0, {self.num_workers})")
        return rank // self.per_node


@dataclass(frozen=True)
class PlacementGroupPlan:
    """One placement group to create: ``bundles`` with ``strategy``; ``slots[(role, rank)] = bundle index``."""

    name: str
    bundles: tuple
    strategy: str
    slots: Mapping[tuple, int]


def _add(a: Mapping[str, float], b: Mapping[str, float], times: float = 1.0) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0.0) + v * times
    return {k: v for k, v in out.items() if v > 0}


def plan_placement(groups: Sequence[RoleGroup], spread_roles: bool = False,
                   name_prefix: str = "sglang") -> list[PlacementGroupPlan]:
    """The placement groups for ``groups`` (see the module docstring).

    Returns:
        plans in creation order; each worker ``(role, rank)`` appears in exactly one plan's ``slots``.
    Raises:
        ValueError: no groups, or two groups with the same role name.
    """
    if not groups:
        raise ValueError("plan_placement: no role groups to place")
    roles = [g.role for g in groups]
    if len(set(roles)) != len(roles):
        raise ValueError(f"plan_placement: role names must be unique, got {roles}")

    def bundles_of(g: RoleGroup, offset: int) -> tuple[list, dict]:
        bundles, slots = [], {}
        for s in range(g.nnodes):
            b = _add({}, g.resources, g.per_node)
            if s == 0:
                b = _add(b, g.extra)
            bundles.append(b)
        for r in range(g.num_workers):
            slots[(g.role, r)] = offset + g.slice_of(r)
        return bundles, slots

    if spread_roles:
        bundles, slots = [], {}
        for g in groups:
            b, s = bundles_of(g, len(bundles))
            bundles += b
            slots.update(s)
        strategy = "STRICT_SPREAD" if len(bundles) > 1 else "STRICT_PACK"
        return [PlacementGroupPlan(f"{name_prefix}-all-roles", tuple(bundles), strategy, slots)]
    plans = []
    for g in groups:
        b, s = bundles_of(g, 0)
        plans.append(PlacementGroupPlan(f"{name_prefix}-{g.role}", tuple(b),
                                        "STRICT_PACK" if g.nnodes == 1 else "STRICT_SPREAD", s))
    return plans
