"""JSON-schema ``$ref`` checks: only local references (``#...``) can be honoured.

xgrammar resolves ``#/$defs/...`` style references inside the schema and has no way to fetch a
document; an external reference (``file://...``, ``http://...``, ``other.json#/x``) was silently
compiled as "any JSON", so the output was unconstrained while the client believed otherwise.
"""

from __future__ import annotations

from typing import Any, Optional


def first_external_ref(schema: Any) -> Optional[str]:
    """The first ``$ref`` value in ``schema`` that does not point inside the schema, or None.

    Walks iteratively (any nesting depth is safe). A reference is local when it starts with ``#``.

    Args:
        schema: a parsed JSON schema (dict / list / scalars).
    """
    stack = [schema]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            ref = v.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                return ref
            if ref is not None and not isinstance(ref, str):
                return repr(ref)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None


def check_schema_refs(schema: Any) -> None:
    """Reject a JSON schema with an external ``$ref``.

    Raises:
        ValueError: naming the reference and the fix (inline it under ``$defs`` and use ``#/$defs/...``).
    """
    ref = first_external_ref(schema)
    if ref is not None:
        shown = ref if len(ref) <= 80 else ref[:77] + "..."
        raise ValueError(f"invalid json_schema: external $ref {shown!r} is not supported (no document is fetched); "
                         "inline the referenced schema under \"$defs\" and refer to it as \"#/$defs/NAME\"")
