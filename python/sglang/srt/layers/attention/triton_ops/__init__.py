"""Alias of the attention kernels in :mod:`sgl_kernel.triton` (split-KV decode, prefix-aware extend; moved there,
see docs/architecture.md). ``sglang.srt.layers.attention.triton_ops.<name>`` is the same module object as
``sgl_kernel.triton.<name>``."""

import importlib as _importlib
import sys as _sys

for _name in ("decode_attention", "extend_attention"):
    _mod = _importlib.import_module(f"sgl_kernel.triton.{_name}")
    _sys.modules[f"{__name__}.{_name}"] = _mod
    globals()[_name] = _mod

from sgl_kernel.triton.decode_attention import (decode_attention_fwd, decode_attention_workspace,  # noqa: E402
                                                default_num_kv_splits)
from sgl_kernel.triton.extend_attention import extend_attention_fwd  # noqa: E402

__all__ = ["decode_attention_fwd", "decode_attention_workspace", "default_num_kv_splits",
           "extend_attention_fwd"]
