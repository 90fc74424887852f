"""Text helpers of the TokenizerManager (chat template rendering, per-token text, decoding).

CPU-only. :class:`TokenizerTextMixin` is mixed into
:class:`~sglang.srt.managers.tokenizer_manager.TokenizerManager`; the host provides ``tokenizer``
(a HF tokenizer or None with ``--skip-tokenizer-init``), ``chat_template`` and a
``_token_text_cache`` dict.
"""

from __future__ import annotations

from typing import Any, Optional

from sglang.srt.managers.template_manager import render_chat


class TokenizerTextMixin:
    """Tokenizer-backed text helpers (see the module docstring for the host contract)."""

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: Optional[list] = None,
                            add_generation_prompt: bool = True) -> list[int]:
        """Render chat ``messages`` to prompt token ids; see :func:`~sglang.srt.managers.template_manager.render_chat`.

        Raises:
            ValueError: no tokenizer (``--skip-tokenizer-init``) or the template fails on ``messages``.
        """
        return render_chat(self.tokenizer, self.chat_template, messages, tools, add_generation_prompt)

    def token_text(self, token_id: int) -> Optional[str]:
        """Text of one token (decoded alone, cached), or None without a tokenizer."""
        if self.tokenizer is None:
            return None
        t = self._token_text_cache.get(token_id)
        if t is None:
            t = self.tokenizer.decode([token_id])
            self._token_text_cache[token_id] = t
        return t

    @property
    def token_pieces(self):
        """:class:`~sglang.srt.managers.token_pieces.TokenPieces` of the tokenizer (exact per-token
        bytes for OpenAI logprobs), built on first use; None without a tokenizer."""
        if self.tokenizer is None:
            return None
        if getattr(self, "_token_pieces", None) is None:
            from sglang.srt.managers.token_pieces import TokenPieces

            self._token_pieces = TokenPieces(self.tokenizer)
        return self._token_pieces

    def decode(self, ids: list[int]) -> str:
        """Decode token ids to text ('' without a tokenizer)."""
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def decode_ids(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Decode token ids to text with ``skip_special_tokens`` ('' without a tokenizer)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
