"""Alias of :mod:`sgl_kernel.triton` (the Triton kernels moved there; see docs/architecture.md).

``sglang.srt.layers.triton_ops.<name>`` is the *same module object* as ``sgl_kernel.triton.<name>`` (registered in
``sys.modules``), so old imports, ``importlib.import_module`` and monkeypatching keep working. Import only where
``triton`` is importable; :mod:`sglang.srt.layers.ops` is the dispatching front end.
"""

import importlib as _importlib
import sys as _sys

_MODULES = ("activation", "common", "decode_fuse", "fused_add_rmsnorm", "moe", "rope", "rope_kv_store",
            "skinny_gemm")

for _name in _MODULES:
    _mod = _importlib.import_module(f"sgl_kernel.triton.{_name}")
    _sys.modules[f"{__name__}.{_name}"] = _mod
    globals()[_name] = _mod
