"""The technique packages the plan composes, and the one check for optional packages.

Each technique module named in :data:`TECHNIQUE_MODULES` exposes the same small surface:

* ``NAME`` and ``enabled(args) -> bool``;
* ``validate(args)``: flag combinations and optional packages, before any process starts (``ValueError`` naming
  both flags of a bad combination; :class:`MissingPackageError` naming the flag and the install command);
* optionally ``executor(args) -> ExecutorSpec``, ``communicator(args, spec) -> CommunicatorSpec``,
  ``connector(args) -> ConnectorSpec``, ``moe_a2a(args, spec) -> MoeA2aSpec``, ``role(args) -> WorkerRole``, ``workers(args, base) -> list[WorkerSpec]``;
* where it has one, ``make_executor(spec, ctx)`` (registered in the executor registry) and
  ``make_connector(spec, scheduler)``.

Importing this module imports no technique (they are imported when enabled).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

TECHNIQUE_MODULES = (
    "sglang.srt.tokenweave.deploy",
    "sglang.srt.distributed.tdist_deploy",
    "sglang.srt.afd.deploy",
    "sglang.srt.disaggregation.deploy",
    "sglang.srt.expert_parallel.deploy",
    "sglang.srt.ray.deploy",
    "sglang.srt.two_batch_overlap.deploy",
    "sglang.srt.dp_attention.deploy",  # last: its hooks see (and override) the others' choices (moe_a2a's scope)
)


class MissingPackageError(ValueError, RuntimeError):
    """A flag needs an optional package that does not import. A ValueError (a bad flag for this environment) and a
    RuntimeError (what a launcher raises when it cannot start); the message is one line: the flag and the fix."""


def require_package(flag: str, module: "str | tuple[str, ...]", install: str, what: str = "") -> None:
    """Raise :class:`MissingPackageError` when ``module`` cannot be found (``importlib.util.find_spec``; nothing is
    imported).

    Args:
        flag: the flag as typed, e.g. ``--enable-afd``.
        module: the top-level module, e.g. ``sgl_kernel``, or alternatives (any one found is enough), e.g.
            NIXL's ``("nixl", "nixl_cu13", "nixl_cu12")`` wheels.
        install: the install command, e.g. ``pip install 'sglang[ray]'``.
        what: the package's name for people (default ``module``), e.g. ``Ray``.
    """
    names = (module,) if isinstance(module, str) else tuple(module)
    if not any(_found(name) for name in names):
        raise MissingPackageError(f"{flag} needs {what or names[0]} (module {' / '.join(map(repr, names))} is not "
                                  f"installed); install it: {install}")


def _found(name: str) -> bool:
    """``name`` can be imported (found on the path; not imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


SGL_KERNEL_INSTALL = "pip install ./sgl-kernel (from a checkout; or the sgl-kernel wheel)"
NIXL_MODULES = ("nixl", "nixl_cu13", "nixl_cu12")  # the nixl meta package or a CUDA-specific wheel
NIXL_INSTALL = "pip install 'sglang[pd]'"


def technique_modules() -> list[ModuleType]:
    """Every technique module (imported; each keeps its runtime imports lazy)."""
    return [importlib.import_module(name) for name in TECHNIQUE_MODULES]


def enabled_techniques(args) -> list[ModuleType]:
    """The technique modules ``args`` turns on, in :data:`TECHNIQUE_MODULES` order."""
    return [m for m in technique_modules() if m.enabled(args)]
