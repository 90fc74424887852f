"""Build a model and fill its weights: HF safetensors checkpoints or seeded random (dummy) weights."""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Iterator, Union

import torch
from torch import nn

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.models.registry import get_model_class

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")
DUMMY_RANGE = 1e-3


def safetensors_files(path: str) -> list[str]:
    """The checkpoint's ``*.safetensors`` files: those named by ``model.safetensors.index.json`` when present,
    else every ``*.safetensors`` in ``path`` (sorted).

    Raises:
        ValueError: no files, an unreadable index, or an index naming a file that does not exist.
    """
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"cannot read safetensors index {index}: {e}") from e
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise ValueError(f"{index} names files that do not exist: {absent}")
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors in {path}; use --load-format dummy for random weights")
    return files


def iterate_safetensors(files: list[str], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` one tensor at a time (CPU), floating tensors cast to ``dtype``.

    Raises:
        ValueError: a file that cannot be opened or read (the message names the file).
    """
    from safetensors import safe_open

    for file in files:
        try:
            handle = safe_open(file, framework="pt", device="cpu")
            names = list(handle.keys())
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"cannot read safetensors file {file}: {e}") from e
        for name in names:
            try:
                tensor = handle.get_tensor(name)
            except Exception as e:
                raise ValueError(f"cannot read tensor {name!r} from safetensors file {file}: {e}") from e
            yield name, (tensor.to(dtype) if tensor.is_floating_point() else tensor)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place from a generator seeded with ``seed`` (deterministic per device):
    RMSNorm weights 1.0, everything else uniform in ``[-1e-3, 1e-3]``."""
    norm_params = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for _, p in model.named_parameters():
            if id(p) in norm_params:
                p.fill_(1.0)
                continue
            gen = gens.get(p.device)
            if gen is None:
                gen = gens[p.device] = torch.Generator(device=p.device)
                gen.manual_seed(seed)
            if p.is_floating_point():
                p.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)


def load_model(model_config: ModelConfig, load_format: str = "auto", device: Union[str, torch.device] = "cpu",
               seed: int = 0) -> nn.Module:
    """Build ``model_config.architecture`` with ``model_config.dtype`` directly on ``device`` and fill its weights.

    Args:
        load_format: "auto"/"safetensors" (read ``model_config.path``) or "dummy"
            (seeded random weights, any size; see :func:`init_dummy_weights`).
        device: where the parameters live.
        seed: dummy-weight seed.
    Returns:
        the model, in eval mode, on ``device``.
    Raises:
        ValueError: unknown load format or architecture, no/corrupt weight files,
            missing or unexpected tensors, shape mismatches.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format={load_format!r} is unknown; choose one of {list(LOAD_FORMATS)}")
    cls = get_model_class(model_config.architecture)
    files = [] if load_format == "dummy" else safetensors_files(model_config.path)
    device = torch.device(device)
    with torch.device(device):
        model = cls(model_config)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        logger.info("loading %d safetensors file(s) from %s", len(files), model_config.path)
        model.load_weights(iterate_safetensors(files, model_config.dtype))
    return model.eval()
