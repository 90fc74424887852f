"""Global memory accesses of a Triton kernel's PTX, each traced back to the kernel arguments its address derives from.

Used by :mod:`sgl_kernel.tdist.aot` to check that every *data* access of a tdist kernel is 16 bytes wide (full-width
memory access). An address is attributed to the arguments reached by following the PTX
register definitions backwards (``add``/``mad``/``mov``/``cvt``/inline-asm ``mov`` of ``consume_token`` ...) until
``ld.param`` of an argument. A value loaded from global memory is attributed as ``"*arg"``, ``arg`` being what its
load address derives from (a peer base or error-record pointer read from ``meta`` gives ``"*meta"``). Predicates
(masks, ``selp`` conditions) are not followed. PTX virtual registers defined several times (loop-carried pointers)
contribute every definition.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Sequence, Set

_REG = re.compile(r"%[a-z]+\d+")
_PARAM = re.compile(r"_param_(\d+)\]")
_ACCESS = re.compile(r"^(ld|st|red|atom)(\.[a-z0-9_]+)*?\.global(\.[a-z0-9_]+)*$|^cp\.async\.c[ag]\.shared\.global$")
_NO_DEST = ("st.", "red.", "cp.", "bar.", "bra", "fence", "membar", "prefetch", "ret", "exit", "@", "trap")
_WIDTH = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2, "b32": 4, "u32": 4,
          "s32": 4, "f32": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8}


@dataclass(frozen=True)
class Access:
    """One global memory instruction. line: 1-based PTX line; text: the instruction; op: ``ld``/``st``/``red``/
    ``atom``/``cp.async``; nbytes: bytes per thread (vector width x element size, or the cp.async size); args:
    names of the arguments the address derives from, ``"*name"`` for a value loaded through ``name`` (empty if
    none was reached); src: the Triton source
    location ``file.py:line`` of the last ``.loc`` before it ("" if none)."""

    line: int
    text: str
    op: str
    nbytes: int
    args: FrozenSet[str]
    src: str


def _statements(ptx: str):
    """(line number, statement without predicate guard, .loc source) for every PTX statement."""
    src = ""
    for no, raw in enumerate(ptx.splitlines(), 1):
        body = raw.split("//")[0].strip()
        if raw.strip().startswith(".loc"):
            m = re.search(r"// (\S+?):(\d+):\d+", raw)
            src = f"{m.group(1)}:{m.group(2)}" if m else src
            continue
        for st in body.split(";"):
            st = re.sub(r"^@!?%p\d+\s+", "", st.strip())
            if st and not st.startswith((".", "$", "{", "}")):
                yield no, st, src


def _split_ops(st: str):
    """opcode, first operand, remaining operands text."""
    parts = st.split(None, 1)
    op, rest = parts[0], (parts[1] if len(parts) > 1 else "")
    rest = rest.strip()
    if rest.startswith("{"):
        end = rest.index("}") + 1
        return op, rest[:end], rest[end:]
    first, _, tail = rest.partition(",")
    return op, first, tail


def _nbytes(op: str, tail: str) -> int:
    if op.startswith("cp.async"):
        size = tail.split(",")[1].strip() if tail.count(",") >= 1 else "0"
        return int(size, 0)
    fields = op.split(".")
    vec = next((int(f[1:]) for f in fields if re.fullmatch(r"v\d", f)), 1)
    return vec * next((_WIDTH[f] for f in reversed(fields) if f in _WIDTH), 0)


def scan_accesses(ptx: str, arg_names: Sequence[str]) -> List[Access]:
    """Every global access in ``ptx`` (``ld/st/red/atom ... .global`` and ``cp.async ... shared.global``) with the
    pointer arguments its address derives from. ``arg_names``: the kernel's PTX parameters in order (its
    non-constexpr arguments; Triton appends scratch pointers, named ``_scratchN`` here). Raises ValueError if the
    PTX references a parameter index with no name."""
    defs: Dict[str, Set[str]] = {}
    params: Dict[str, Set[str]] = {}
    loaded: Dict[str, Set[str]] = {}
    raw_access = []
    for no, st, src in _statements(ptx):
        op, first, tail = _split_ops(st)
        if _ACCESS.match(op):
            addr_operand = first if op.startswith(("st.", "red.")) else tail
            if op.startswith("cp.async"):
                addr_operand = tail.split(",")[0]
            m = re.search(r"\[\s*(%[a-z]+\d+)", addr_operand)
            kind = "cp.async" if op.startswith("cp.async") else op.split(".")[0]
            raw_access.append((no, st, kind, _nbytes(op, tail), m.group(1) if m else "", src))
            if op.startswith(("ld.", "atom.")) and m:
                for r in _REG.findall(first):
                    loaded.setdefault(r, set()).add(m.group(1))  # a loaded value: attributed as "*arg"
            continue
        if op.startswith(_NO_DEST) or not first:
            continue
        dests = _REG.findall(first)
        if op.startswith("ld.param"):
            pm = _PARAM.search(tail)
            if pm:
                idx = int(pm.group(1))
                name = arg_names[idx] if idx < len(arg_names) else f"_scratch{idx - len(arg_names)}"
                for r in dests:
                    params.setdefault(r, set()).add(name)
            continue
        srcs = {r for r in _REG.findall(tail) if not r.startswith("%p")}
        for r in dests:
            defs.setdefault(r, set()).update(srcs)
    memo: Dict[str, FrozenSet[str]] = {}

    def origin(reg: str) -> FrozenSet[str]:
        if reg in memo:
            return memo[reg]
        memo[reg] = frozenset()  # cycle guard
        seen, stack, found = {reg}, [reg], set()
        while stack:
            r = stack.pop()
            found |= params.get(r, set())
            for addr in loaded.get(r, ()):
                found |= {"*" + a.lstrip("*") for a in origin(addr)}
            for s in defs.get(r, ()):
                if s not in seen:
                    seen.add(s)
                    stack.append(s)
        memo[reg] = frozenset(found)
        return memo[reg]

    return [Access(no, st, kind, nb, origin(reg) if reg else frozenset(), src)
            for no, st, kind, nb, reg, src in raw_access]
