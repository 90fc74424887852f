"""Render ``system`` / ``user`` / ``assistant`` roles of a program with the model's Jinja chat template.

A program's text grows piece by piece (a role opens, its content is added or generated, the role
closes), but chat templates render whole conversations. :class:`ChatTemplate` bridges the two by
rendering the conversation with a unique sentinel string as each message's content and reading the
text around the sentinels:

- at a role's begin it renders ``history + [{role, SENTINEL}]`` and emits whatever the canonical
  text up to the new sentinel (earlier contents substituted back) adds to what was already emitted;
- at a role's end it emits the rendering's tail after the closed message's sentinel.

So a completed conversation's text equals ``apply_chat_template(messages, tokenize=False)`` and the
text right after an ``assistant`` begin equals the generation prompt (``add_generation_prompt=True``)
for templates whose assistant header does not depend on later messages (Llama-3, ChatML/Qwen2, ...).
Message contents are inserted verbatim (a template that ``trim``-s contents renders differently
only for contents with surrounding whitespace). Templates that rewrite earlier turns once a later
one exists cannot be rendered incrementally; then only the new role's own header is emitted and a
warning is logged.

Without a template, :func:`default_chat_template` renders ``"{role}: {content}\\n"`` per message
(the server's own fallback for template-less models).
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Mapping, Optional, Sequence

logger = logging.getLogger(__name__)

RenderFn = Callable[[list[dict[str, Any]]], str]


@dataclass(frozen=True)
class ChatTemplate:
    """Incremental role rendering with a conversation renderer.

    Args:
        render: ``render(messages) -> str``: the full conversation (``[{"role", "content"}]``) as text,
            without a generation prompt.
        name: a label for logs.
        strip_prefix: text (e.g. the BOS token's text) that a backend should remove from the start of
            the prompt it sends, because the server's tokenizer adds that token itself.
    """

    render: RenderFn
    name: str = "custom"
    strip_prefix: Optional[str] = None
    _nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def _sentinel(self, i: int) -> str:
        return f"SGLMSG{self._nonce}N{i}E"

    def _render_with_sentinels(self, messages: Sequence[Mapping[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """Render with sentinel contents; return the text and each sentinel's (start, end)."""
        conv = [{"role": m["role"], "content": self._sentinel(i)} for i, m in enumerate(messages)]
        try:
            text = self.render(conv)
        except Exception as e:  # jinja raises many types; roles in an order the template forbids, ...
            roles = [m["role"] for m in messages]
            raise ValueError(f"the chat template ({self.name}) cannot render roles {roles}: {e}") from e
        spans, pos = [], 0
        for i in range(len(conv)):
            s = self._sentinel(i)
            at = text.find(s, pos)
            if at < 0:
                raise ValueError(f"the chat template ({self.name}) drops message {i} ({messages[i]['role']}); "
                                 "such templates cannot render sgl roles")
            spans.append((at, at + len(s)))
            pos = at + len(s)
        return text, spans

    def role_begin(self, history: Sequence[Mapping[str, Any]], role: str, emitted: str) -> str:
        """Text to emit when ``role`` opens after the completed messages ``history``.

        Args:
            history: the completed messages ``[{"role", "content"}]``, in order.
            role: the role that opens.
            emitted: all text the roles of this program emitted so far (headers, contents, tails).

        Raises:
            ValueError: the template cannot render this sequence of roles.
        """
        text, spans = self._render_with_sentinels([*history, {"role": role, "content": ""}])
        canonical, prev = [], 0
        for (a, b), m in zip(spans[:-1], history):
            canonical.append(text[prev:a])
            canonical.append(str(m["content"]))
            prev = b
        canonical.append(text[prev:spans[-1][0]])
        full = "".join(canonical)
        if full.startswith(emitted):
            return full[len(emitted):]
        logger.warning("chat template %s re-renders earlier turns when a %s turn is added; emitting only the "
                       "new turn's header", self.name, role)
        header = text[prev:spans[-1][0]]
        if history:
            last_tail = self._tail(history)
            if header.startswith(last_tail):
                header = header[len(last_tail):]
        return header

    def _tail(self, messages: Sequence[Mapping[str, Any]]) -> str:
        text, spans = self._render_with_sentinels(messages)
        return text[spans[-1][1]:]

    def role_end(self, history: Sequence[Mapping[str, Any]]) -> str:
        """Text to emit when the last message of ``history`` (now complete) closes.

        Raises:
            ValueError: ``history`` is empty or the template cannot render it.
        """
        if not history:
            raise ValueError("role_end needs at least the message that closes")
        return self._tail(history)


def _render_fallback(messages: list[dict[str, Any]]) -> str:
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


def default_chat_template() -> ChatTemplate:
    """Roles as ``"{role}: {content}\\n"`` (for models without a chat template)."""
    return ChatTemplate(render=_render_fallback, name="default")


def _bos_to_strip(tokenizer: Any) -> Optional[str]:
    """The BOS text when the tokenizer adds BOS by itself on ``encode`` (so a rendered BOS would double)."""
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None:
        return None
    try:
        ids = tokenizer.encode("a")
    except Exception:  # an odd tokenizer: do not strip
        return None
    return bos if ids and ids[0] == bos_id else None


def from_tokenizer(tokenizer: Any, chat_template: Optional[str] = None) -> ChatTemplate:
    """A :class:`ChatTemplate` rendering with a Hugging Face tokenizer's ``apply_chat_template``.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        chat_template: a Jinja template overriding the tokenizer's own (e.g. the server's
            ``--chat-template``); None uses the tokenizer's. Without either the default template is used.
    """
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        return default_chat_template()

    def render(messages: list[dict[str, Any]]) -> str:
        """The messages rendered by the tokenizer's chat template (no generation prompt)."""
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                             chat_template=template)

    name = getattr(tokenizer, "name_or_path", "") or "tokenizer"
    return ChatTemplate(render=render, name=str(name), strip_prefix=_bos_to_strip(tokenizer))


def _jinja_env():
    """A sandboxed Jinja environment configured like transformers' chat-template renderer."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            """Parse ``{% generation %}`` up to ``{% endgeneration %}`` into a plain scope."""
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message: str):
        """Template helper: raise a jinja2 TemplateError with ``message``."""
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        """Template filter: ``json.dumps`` keeping non-ASCII characters by default."""
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def from_template(template: str, special_tokens: Optional[Mapping[str, Optional[str]]] = None,
                  strip_prefix: Optional[str] = None, name: str = "template") -> ChatTemplate:
    """A :class:`ChatTemplate` rendering a Jinja template text directly (no tokenizer needed).

    Args:
        template: the Jinja chat template.
        special_tokens: values for ``bos_token``, ``eos_token``, ... used by the template.
        strip_prefix: see :class:`ChatTemplate`.

    Raises:
        ValueError: the template does not compile.
    """
    import jinja2

    try:
        compiled = _jinja_env().from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the chat template does not compile: {e}") from e
    tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}

    def render(messages: list[dict[str, Any]]) -> str:
        """The messages rendered by the compiled template (no generation prompt)."""
        return compiled.render(messages=messages, add_generation_prompt=False, **tokens)

    return ChatTemplate(render=render, name=name, strip_prefix=strip_prefix)


def _render_chatml(messages: list[dict[str, Any]]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def _render_llama3(messages: list[dict[str, Any]]) -> str:
    return "<|begin_of_text|>" + "".join(
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>" for m in messages)


def _named_templates() -> dict[str, Callable[[], ChatTemplate]]:
    return {
        "default": default_chat_template,
        "chatml": lambda: ChatTemplate(render=_render_chatml, name="chatml"),
        "qwen": lambda: ChatTemplate(render=_render_chatml, name="qwen"),
        "llama-3-instruct": lambda: ChatTemplate(render=_render_llama3, name="llama-3-instruct",
                                                 strip_prefix="<|begin_of_text|>"),
    }


def get_chat_template_by_name(name: str) -> ChatTemplate:
    """A built-in template by SGLang's name (``RuntimeEndpoint(chat_template_name=...)``).

    Known names: ``default`` (``"role: content"`` lines), ``chatml`` and ``qwen``
    (``<|im_start|>role ... <|im_end|>``), ``llama-3-instruct`` (Llama-3 headers; the BOS text is
    stripped from prompts because the server's tokenizer adds the BOS token).

    Raises:
        ValueError: an unknown ``name`` (the message lists the known ones).
    """
    table = _named_templates()
    if name not in table:
        raise ValueError(f"unknown chat_template_name {name!r}; known: {', '.join(sorted(table))} "
                         "(or pass chat_template=<jinja text>, or let the server's template be used)")
    return table[name]()
