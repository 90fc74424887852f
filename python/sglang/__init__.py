"""sglang-tw: an SGLang-compatible serving engine (this fork's ``sglang`` package).

The server lives in :mod:`sglang.srt`; start it with ``python -m sglang.launch_server``.
The frontend language (``import sglang as sgl``: ``sgl.function``, ``sgl.gen``, ``sgl.select``,
roles, ``fork``, backends) lives in :mod:`sglang.lang` and :mod:`sglang.api`; ``sgl.Engine`` is the
in-process engine (:mod:`sglang.srt.entrypoints.engine`). Everything is imported lazily on first
attribute access, so ``import sglang`` stays light (no torch, no HTTP client).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> (module, attribute)
_LAZY = {
    **{name: ("sglang.api", name) for name in (
        "function", "gen", "gen_int", "gen_string", "select", "system", "user", "assistant", "system_begin", "system_end",
        "user_begin", "user_end", "assistant_begin", "assistant_end", "set_default_backend",
        "get_default_backend", "flush_cache", "get_server_info")},
    **{name: ("sglang.lang.choices", name) for name in (
        "token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized")},
    "RuntimeEndpoint": ("sglang.lang.backend.runtime_endpoint", "RuntimeEndpoint"),
    "OpenAI": ("sglang.lang.backend.openai", "OpenAI"),
    "Runtime": ("sglang.lang.runtime", "Runtime"),
    "ProgramState": ("sglang.lang.state", "ProgramState"),
    "Engine": ("sglang.srt.entrypoints.engine", "Engine"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'sglang' has no attribute {name!r}")
    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
