"""Chat templates: ``--chat-template`` loading and rendering OpenAI-style messages to prompt ids.

CPU-only; the TokenizerManager calls these for ``/v1/chat/completions`` and the DSL's roles.
"""

from __future__ import annotations

import os
from typing import Any, Optional


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """Resolve ``--chat-template``: a path to a Jinja file (read) or a Jinja template string (kept).

    Args:
        value: the flag's value; None or empty means "use the tokenizer's own template".
    Returns:
        The template text, or None.
    Raises:
        ValueError: ``value`` is neither an existing file nor Jinja text (names the value and the fix).
    """
    if not value:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{%" not in value and "{{" not in value:
        raise ValueError(f"--chat-template={value!r} is neither a file nor a Jinja template; "
                         "pass a path to a .jinja file or the template text")
    return value


def render_chat(tokenizer, template: Optional[str], messages: list[dict[str, Any]],
                tools: Optional[list] = None, add_generation_prompt: bool = True) -> list[int]:
    """Render chat ``messages`` (OpenAI dicts, ``content`` a string) to prompt token ids.

    Uses ``template`` if given, else the tokenizer's chat template (its output already holds any
    BOS, so it is encoded without adding special tokens). Without either (e.g. a base model) it
    uses a plain fallback ``"role: content\\n"`` per message plus ``"assistant:"``, encoded with
    the tokenizer's default special tokens.

    Args:
        tokenizer: a transformers tokenizer, or None (``--skip-tokenizer-init``).
        template: the ``--chat-template`` text, or None.
        messages, tools, add_generation_prompt: as ``transformers``' ``apply_chat_template``.
    Returns:
        The prompt's token ids.
    Raises:
        ValueError: no tokenizer, or the template fails on ``messages``.
    """
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer but the server runs with --skip-tokenizer-init")
    template = template or getattr(tokenizer, "chat_template", None)
    if template:
        try:
            text = tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                chat_template=template)
        except Exception as e:  # jinja raises many types
            raise ValueError(f"messages cannot be rendered by the chat template: {e}") from e
        return list(tokenizer.encode(text, add_special_tokens=False))
    text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
    if add_generation_prompt:
        text += "assistant:"
    return list(tokenizer.encode(text))
