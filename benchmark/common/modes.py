"""One entry point per question: a subject's ``bench.py`` names its modes and hands the rest of the command line to
the module that measures that mode (imported only when chosen, so ``--help`` needs neither torch nor a GPU).

Usage in a subject folder::

    MODES = {"step": Mode("benchmark.decode.step_ab", "decode step vs the memory floor, host path A/B"), ...}
    sys.exit(run_mode(MODES, sys.argv[1:], prog="python -m benchmark.decode.bench"))

``python -m benchmark.decode.bench --list`` lists the modes; ``... <mode> --help`` shows that mode's own options.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import Mapping, Sequence

__all__ = ["Mode", "run_mode", "mode_help"]


@dataclasses.dataclass(frozen=True)
class Mode:
    """``module``: the dotted module whose ``main()`` runs the mode; ``help``: one line for ``--list``."""

    module: str
    help: str


def mode_help(modes: Mapping[str, Mode], prog: str) -> str:
    """The usage text: ``prog MODE [ARGS...]`` and one line per mode."""
    width = max(len(m) for m in modes)
    lines = [f"usage: {prog} MODE [ARGS...]   ({prog} MODE --help: the mode's own options)", "", "modes:"]
    lines += [f"  {name:<{width}}  {mode.help}  [{mode.module}]" for name, mode in modes.items()]
    return "\n".join(lines)


def run_mode(modes: Mapping[str, Mode], argv: Sequence[str], prog: str) -> int:
    """Run ``modes[argv[0]]`` with ``argv[1:]``: the module's ``main()`` sees them as its ``sys.argv[1:]`` (so the
    command it records is the module's own, which reproduces the run). No mode, ``-h``/``--help`` or ``--list``
    prints the modes; an unknown mode exits 2 naming the known ones. Returns the mode's exit status (0 for a
    ``main`` that returns a path or None)."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(mode_help(modes, prog))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in modes:
        print(f"{prog}: unknown mode {name!r}; modes: {', '.join(modes)}", file=sys.stderr)
        return 2
    module = importlib.import_module(modes[name].module)
    saved = sys.argv
    sys.argv = [module.__file__, *rest]
    try:
        status = module.main()
    finally:
        sys.argv = saved
    return status if isinstance(status, int) else 0

