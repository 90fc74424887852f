"""Role-aware model construction: a worker builds only the parameters its role holds.

The model class is constructed on the ``meta`` device (shapes, names and loader attributes only, no memory);
then every parameter the role holds is allocated on the worker's device, and every buffer is recomputed there
by its module's ``reset_buffers(device)`` (e.g. RoPE's cos/sin cache). Parameters the role does not hold stay
on ``meta`` and take no memory -- an attention worker of attention/FFN disaggregation never allocates routed
experts, an FFN worker never allocates attention (MegaScale-Infer, Zhu et al. 2025, sec. 3: the two roles are
separate node types).
"""

from __future__ import annotations

import logging
from typing import Callable, Union

import torch
from torch import nn

logger = logging.getLogger(__name__)


def param_bytes(model: nn.Module, include_meta: bool = False) -> int:
    """Bytes of ``model``'s parameters (tied parameters counted once); ``meta`` ones only if ``include_meta``."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen or (p.is_meta and not include_meta):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def held_param_bytes(model: nn.Module, holds_param: Callable[[str], bool]) -> int:
    """Bytes of the parameters ``holds_param`` (our parameter name -> held) selects, on any device (``meta``
    too: the count needs no memory). Tied parameters are counted once."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen or not holds_param(name):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def build_for_role(construct: Callable[[], nn.Module], device: Union[str, torch.device],
                   holds_param: Callable[[str], bool]) -> nn.Module:
    """Construct a model with only the parameters a role holds.

    Args:
        construct: ``() -> nn.Module`` building the model class (called under ``torch.device("meta")``).
        device: where held parameters and all buffers go (``meta`` builds nothing at all).
        holds_param: our parameter name (e.g. ``model.layers.3.mlp.experts.w13_weight``) -> whether the role
            holds it. Held parameters are allocated uninitialized (the loader fills them); others stay on
            ``meta`` with their attributes (``weight_loader``...) so names and shapes stay inspectable.
    Returns:
        the model; its memory is that of the held parameters and the buffers.
    Raises:
        ValueError: a module has a buffer but no ``reset_buffers(device)`` to recompute it.
    """
    device = torch.device(device)
    with torch.device("meta"):
        model = construct()
    memo: dict[int, nn.Parameter] = {}
    for mod_name, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            if id(p) in memo:  # tied (e.g. lm_head = embed_tokens): keep it tied
                mod._parameters[pname] = memo[id(p)]
                continue
            if not holds_param(full) or device.type == "meta":
                continue
            new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
            new.__dict__.update(p.__dict__)
            memo[id(p)] = new
            mod._parameters[pname] = new
        if device.type != "meta" and any(b is not None and b.is_meta for b in mod._buffers.values()):
            reset = getattr(mod, "reset_buffers", None)
            if reset is None:
                raise ValueError(f"{type(mod).__name__} ({mod_name}) has buffers but no reset_buffers(device); "
                                 "it cannot be built per role")
            reset(device)
    return model
