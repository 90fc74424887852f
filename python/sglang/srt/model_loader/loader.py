"""Build a model and fill its weights: HF safetensors checkpoints or seeded random (dummy) weights."""

from __future__ import annotations

import copy
import glob
import json
import logging
import os
import zlib
from typing import Callable, Optional, Iterator, Union

import torch
from torch import nn

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.model_loader.kv_scales import is_kv_scale_name
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


_FLOAT_CODES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


class SafetensorsSlice:
    """A checkpoint tensor that is not read yet (one rank reads only its shard of it).

    ``shape`` (torch.Size) and ``dim()`` come from the file header; ``narrow(dim, start, length)`` reads
    just that slice through ``safe_open(...).get_slice`` and returns a CPU tensor (floating tensors cast
    to ``dtype``); ``materialize()`` reads it whole. Weight loaders narrow first (see
    :func:`sglang.srt.layers.linear.materialize`), so a tensor-parallel rank never materializes a sharded
    tensor in full.
    Raises (from the readers): ValueError naming the tensor and the file when reading fails.
    """

    def __init__(self, handle, name: str, file: str, dtype: torch.dtype):
        self.name, self.file, self.dtype = name, file, dtype
        try:
            self._slice = handle.get_slice(name)
            self.shape = torch.Size(self._slice.get_shape())
            self._float = self._slice.get_dtype() in _FLOAT_CODES
        except Exception as e:
            raise ValueError(f"cannot read tensor {name!r} from safetensors file {file}: {e}") from e

    def dim(self) -> int:
        """Number of dimensions (from the file header)."""
        return len(self.shape)

    def is_floating_point(self) -> bool:
        """True for floating-point checkpoint dtypes (those are cast to ``dtype`` when read)."""
        return self._float

    def _read(self, index) -> torch.Tensor:
        try:
            t = self._slice[index]
        except Exception as e:
            raise ValueError(f"cannot read tensor {self.name!r} from safetensors file {self.file}: {e}") from e
        return t.to(self.dtype) if self._float and self.dtype is not None else t

    def stored(self) -> "SafetensorsSlice":
        """The same tensor read in its file dtype (no cast to ``dtype``): FP8 weights and their float32 / bf16 scales
        (:mod:`sglang.srt.layers.quantization`) must not be rounded to the model dtype."""
        raw = copy.copy(self)
        raw.dtype = None
        return raw

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows ``[start, start+length)`` of dimension ``dim`` (ValueError when out of range)."""
        if not 0 <= dim < self.dim() or start < 0 or start + length > self.shape[dim]:
            raise ValueError(f"tensor {self.name!r}: narrow(dim={dim}, start={start}, length={length}) is outside "
                             f"its shape {tuple(self.shape)}")
        return self._read(tuple([slice(None)] * dim + [slice(start, start + length)]))

    def materialize(self) -> torch.Tensor:
        """The whole tensor as a CPU tensor (ValueError naming the tensor and file when reading fails)."""
        if self.dim() == 0:
            return self._read(())
        return self._read(tuple(slice(None) for _ in self.shape))

    def __repr__(self) -> str:
        return f"SafetensorsSlice({self.name!r}, shape={tuple(self.shape)}, file={os.path.basename(self.file)!r})"


def iterate_safetensors(files: list[str], dtype: torch.dtype,
                        lazy: bool = False) -> Iterator[tuple[str, Union[torch.Tensor, SafetensorsSlice]]]:
    """Yield ``(name, tensor)`` one tensor at a time (CPU), floating tensors cast to ``dtype``.

    With ``lazy=True`` the tensors are :class:`SafetensorsSlice` objects read on demand (a TP rank
    reads only its slice).
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
            if lazy:
                yield name, SafetensorsSlice(handle, name, file, dtype)
                continue
            try:
                tensor = handle.get_tensor(name)
            except Exception as e:
                raise ValueError(f"cannot read tensor {name!r} from safetensors file {file}: {e}") from e
            yield name, (tensor.to(dtype) if tensor.is_floating_point() else tensor)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place, deterministically per (seed, parameter name, shape, device):
    RMSNorm weights 1.0, a parameter with a ``dummy_init(param, generator)`` hook (FP8 weights and scales) by its
    hook, everything else uniform in ``[-1e-3, 1e-3]``, each from a generator seeded with ``seed + crc32(name)``.
    Replicated parameters (same name and shape on every TP rank) are thus equal on
    all ranks; sharded ones differ per rank (random weights either way)."""
    norm_params = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_meta:  # not held by this worker's role (see role_build)
                continue
            if id(p) in norm_params:
                p.fill_(1.0)
                continue
            init = getattr(p, "dummy_init", None)  # e.g. FP8 weights and scales (sglang.srt.layers.quantization)
            if init is not None:
                gen = torch.Generator(device=p.device)
                gen.manual_seed(seed + zlib.crc32(name.encode()))
                init(p, gen)
                continue
            if p.is_floating_point():
                gen = torch.Generator(device=p.device)
                gen.manual_seed(seed + zlib.crc32(name.encode()))
                p.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)


def load_model(model_config: ModelConfig, load_format: str = "auto", device: Union[str, torch.device] = "cpu",
               seed: int = 0, tp_rank: int = 0, tp_size: int = 1, comm=None, ep_size: int = 1,
               weight_filter: Optional[Callable[[str], bool]] = None,
               holds_param: Optional[Callable[[str], bool]] = None,
               layout: Optional[Callable[[nn.Module], None]] = None, quantization: Optional[str] = None) -> nn.Module:
    """Build ``model_config.architecture`` with ``model_config.dtype`` directly on ``device`` and fill its weights.

    Args:
        load_format: "auto"/"safetensors" (read ``model_config.path``) or "dummy"
            (seeded random weights, any size; see :func:`init_dummy_weights`).
        device: where the parameters live.
        seed: dummy-weight seed.
        tp_rank, tp_size, comm, ep_size: tensor/expert parallelism (see the model classes). Checkpoint
            tensors are read lazily (:class:`SafetensorsSlice`): each rank reads only its slices.
        weight_filter: HF tensor name -> whether this worker loads it (a role's part of the checkpoint,
            see :mod:`sglang.srt.model_executor.worker_builder`); tensors filtered out are not read and
            the parameters they would fill are not reported missing. None: load everything.
        holds_param: our parameter name -> whether this worker's role holds it; given, the model is built on
            ``meta`` and only held parameters are allocated (:func:`~sglang.srt.model_loader.role_build.
            build_for_role`), e.g. an attention worker never allocates routed experts. None: build everything.
        layout: applied to the freshly constructed model before any parameter is allocated (the model is then
            built on ``meta`` first, as for ``holds_param``): a deployment's change of the model's parallel layout
            without a model-file change, e.g. DP attention's expert sharding
            (:meth:`~sglang.srt.dp_attention.rank.DpAttentionRank.layout`). None: the model as its class builds it.
        quantization: ``--quantization`` (None or ``"fp8"``). With it, or with a ``quantization_config`` in the
            checkpoint's config.json, the model is built on ``meta``, every linear / MoE layer gets its quantization
            method (:func:`~sglang.srt.layers.quantization.apply_quantization`: FP8 weights and scales replace the
            model-dtype ones), and only then are parameters allocated, so the model-dtype weights of quantized
            layers never take device memory.
    Returns:
        the model, in eval mode, on ``device``.
    Raises:
        ValueError: unknown load format or architecture, no/corrupt weight files,
            missing or unexpected tensors, shape mismatches, an unsupported quantization (naming the field).
    """
    from sglang.srt.layers.quantization import apply_quantization, finish_loading, resolve_quant_config

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format={load_format!r} is unknown; choose one of {list(LOAD_FORMATS)}")
    cls = get_model_class(model_config.architecture)
    files = [] if load_format == "dummy" else safetensors_files(model_config.path)
    device = torch.device(device)
    def construct() -> nn.Module:
        if tp_size == 1 and ep_size == 1 and comm is None:
            return cls(model_config)
        return cls(model_config, tp_rank=tp_rank, tp_size=tp_size, comm=comm, ep_size=ep_size)

    quant = resolve_quant_config(model_config.hf_config, quantization)

    def construct_for_build() -> nn.Module:
        built = construct()
        if layout is not None:  # the deployment's layout first: quantization methods go on the final modules
            layout(built)
        if quant is not None:
            apply_quantization(built, quant)
        return built

    if holds_param is not None or layout is not None or quant is not None:
        from sglang.srt.model_loader.role_build import build_for_role

        if quant is not None:
            logger.info("weights: %s", quant.describe())
        model = build_for_role(construct_for_build, device, holds_param or (lambda name: True))
    else:
        with torch.device(device):
            model = construct()
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        logger.info("loading %d safetensors file(s) from %s", len(files), model_config.path)
        # FP8 KV-cache scales belong to the KV cache, not to a module (read by model_loader/kv_scales.py)
        weights = ((n, t) for n, t in iterate_safetensors(files, model_config.dtype, lazy=True)
                   if not is_kv_scale_name(n))
        if weight_filter is None:
            model.load_weights(weights)
        else:
            model.load_weights(((n, t) for n, t in weights if weight_filter(n)), weight_filter=weight_filter)
    finish_loading(model)
    return model.eval()
