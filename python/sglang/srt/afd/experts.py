"""The FFN worker's experts: a set of routed experts per MoE layer, any subset (with redundant copies after
load balancing), loaded straight from the checkpoint -- the FFN role of MegaScale-Infer (Zhu et al. 2025,
sec. 3): no attention, no KV cache, no dense parts.

:func:`moe_layer_specs` finds the MoE layers by building the model class on the ``meta`` device (no memory),
so Mixtral, Qwen2-MoE (sparse-step layers, shared expert left on the attention side) and Qwen3-MoE need no
per-model code here, and :func:`load_expert_weights` reads only the held experts' tensors through the model's
own HF-name mapping (``map_weight_name``).
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass
from typing import Sequence

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers import ops
from sglang.srt.layers.linear import materialize

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MoeLayerSpec:
    """One MoE layer: ``layer`` index, ``param_prefix`` (our name of its FusedMoE, e.g.
    ``model.layers.3.mlp.experts``), ``num_experts`` E, ``top_k``, ``hidden`` H, ``intermediate`` I, ``renormalize``."""

    layer: int
    param_prefix: str
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    renormalize: bool


def build_meta_model(mc: ModelConfig):
    """The model class built on the ``meta`` device (shapes and names only, no memory)."""
    from sglang.srt.models.registry import get_model_class

    with torch.device("meta"):
        return get_model_class(mc.architecture)(mc)


def moe_layer_specs(mc: ModelConfig) -> list[MoeLayerSpec]:
    """The MoE layers of ``mc``'s model (empty for a dense model)."""
    from sglang.srt.layers.moe.sparse_moe_block import SparseMoeBlock

    model = build_meta_model(mc)
    out = []
    for i, layer in enumerate(model.decoder_layers):
        if isinstance(layer.mlp, SparseMoeBlock):
            fm = layer.mlp.experts
            out.append(MoeLayerSpec(i, f"model.layers.{i}.mlp.experts", fm.num_experts, fm.top_k, fm.hidden_size,
                                    fm.i_local * fm.moe_tp_size, fm.renormalize))
    return out


class ExpertShard:
    """One MoE layer's experts held by this FFN worker.

    Args:
        spec: the layer.
        expert_ids: global ids held (distinct; any subset of ``[0, E)``).
        w13: ``[n, 2I, H]`` (gate rows then up rows), w2: ``[n, H, I]``, model dtype, on the worker's device.
    ``compute(x [T, H], topk_ids [T, k] int, topk_weights [T, k] fp32) -> [T, H]``: the weighted sum over the
    (token, slot) pairs whose weight is non-zero; such a pair naming an expert not held raises ValueError
    (fail closed: a stale placement never yields silently wrong outputs).
    """

    def __init__(self, spec: MoeLayerSpec, expert_ids: Sequence[int], w13: torch.Tensor, w2: torch.Tensor):
        self.spec = spec
        self.expert_ids = [int(e) for e in expert_ids]
        self.w13, self.w2 = w13, w2
        lut = torch.full((spec.num_experts,), -1, dtype=torch.int64)
        lut[torch.tensor(self.expert_ids, dtype=torch.int64)] = torch.arange(len(self.expert_ids))
        self.lut = lut.to(w13.device)
        self.holds_all = len(set(self.expert_ids)) == spec.num_experts  # no pair can name a missing expert

    def compute(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """See the class docstring."""
        if x.shape[0] == 0 or not self.expert_ids:
            return torch.zeros_like(x)
        local = self.lut[topk_ids.long()]
        if self.holds_all:  # every id maps: no check, so no host sync per layer (the 1 + 1 AFD deployment)
            return ops.fused_moe(x, self.w13, self.w2, topk_weights, local)
        stray = (local < 0) & (topk_weights != 0)
        if bool(stray.any()):  # a partial holder checks on the host (one sync per layer): fail closed
            bad = sorted(set(topk_ids[stray].tolist()))
            raise ValueError(f"layer {self.spec.layer}: tokens routed to experts {bad} that this FFN worker does not "
                             f"hold (holds {self.expert_ids}); the placements of attention and FFN workers disagree")
        w = topk_weights.masked_fill(local < 0, 0.0)
        return ops.fused_moe(x, self.w13, self.w2, w, local.clamp(min=0))


    def compute_device(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`compute` without a host synchronization (CUDA-graph capturable): ``(out [T, H], ok)`` where ``ok``
        is a bool scalar tensor on the device, False when a (token, slot) pair with a non-zero weight names an
        expert not held (those pairs contribute nothing; the caller must fail the step on ``ok == False``)."""
        if x.shape[0] == 0 or not self.expert_ids:
            return torch.zeros_like(x), torch.ones((), dtype=torch.bool, device=x.device)
        local = self.lut[topk_ids.long()]
        if self.holds_all:
            return ops.fused_moe(x, self.w13, self.w2, topk_weights, local), torch.ones((), dtype=torch.bool,
                                                                                      device=x.device)
        ok = ~((local < 0) & (topk_weights != 0)).any()
        w = topk_weights.masked_fill(local < 0, 0.0)
        return ops.fused_moe(x, self.w13, self.w2, w, local.clamp(min=0)), ok


def load_expert_weights(mc: ModelConfig, specs: Sequence[MoeLayerSpec], expert_ids: Sequence[int],
                        load_format: str, device: torch.device, seed: int = 0) -> list[ExpertShard]:
    """Read experts ``expert_ids`` of every layer in ``specs``: from the checkpoint (only those tensors), or
    for ``load_format="dummy"`` the same seeded values :func:`~sglang.srt.model_loader.loader.init_dummy_weights`
    gives the colocated model (a slice of the full parameter).

    Raises:
        ValueError: a held expert's tensor is missing or has the wrong shape.
    """
    from sglang.srt.model_loader.loader import DUMMY_RANGE, iterate_safetensors, safetensors_files
    ids = [int(e) for e in expert_ids]
    pos = {e: i for i, e in enumerate(ids)}
    shards = []
    if load_format == "dummy":
        for s in specs:
            params = []
            for pname, shape in ((f"{s.param_prefix}.w13_weight", (s.num_experts, 2 * s.intermediate, s.hidden)),
                                 (f"{s.param_prefix}.w2_weight", (s.num_experts, s.hidden, s.intermediate))):
                full = torch.empty(shape, dtype=mc.dtype, device=device)
                gen = torch.Generator(device=device)
                gen.manual_seed(seed + zlib.crc32(pname.encode()))
                full.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)
                params.append(full[ids].clone())
            shards.append(ExpertShard(s, ids, *params))
        return shards
    meta = build_meta_model(mc)
    by_prefix = {s.param_prefix: s for s in specs}
    w13 = {s.param_prefix: torch.zeros(len(ids), 2 * s.intermediate, s.hidden, dtype=mc.dtype, device=device)
           for s in specs}
    w2 = {s.param_prefix: torch.zeros(len(ids), s.hidden, s.intermediate, dtype=mc.dtype, device=device)
          for s in specs}
    seen: set[tuple[str, int, str]] = set()
    for name, tensor in iterate_safetensors(safetensors_files(mc.path), mc.dtype, lazy=True):
        target = meta.map_weight_name(name)
        if target is None or not isinstance(target[1], tuple):
            continue
        pname, (eid, shard) = target
        prefix = pname.rsplit(".", 1)[0]
        if prefix not in by_prefix or eid not in pos:
            continue
        s = by_prefix[prefix]
        t = materialize(tensor).to(device=device, dtype=mc.dtype)
        want = (s.hidden, s.intermediate) if shard == "w2" else (s.intermediate, s.hidden)
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: shape {tuple(t.shape)} != expected {want}")
        i, n = pos[eid], s.intermediate
        if shard == "w1":
            w13[prefix][i, :n].copy_(t)
        elif shard == "w3":
            w13[prefix][i, n:].copy_(t)
        else:
            w2[prefix][i].copy_(t)
        seen.add((prefix, eid, shard))
    missing = [(p, e, sh) for p in by_prefix for e in ids for sh in ("w1", "w2", "w3") if (p, e, sh) not in seen]
    if missing:
        raise ValueError(f"{mc.path}: expert tensors missing from the checkpoint: {missing[:10]}")
    for s in specs:
        shards.append(ExpertShard(s, ids, w13[s.param_prefix], w2[s.param_prefix]))
    return shards
