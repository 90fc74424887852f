"""Exact per-token text and bytes for OpenAI logprobs (``tokens``, ``text_offset``, ``bytes``).

Decoding one token id alone loses what the token means inside a sequence: SentencePiece-style
tokenizers drop the leading space of ``"▁there"`` at the start of a decode, and a byte-fallback or
byte-level token that holds part of a UTF-8 character decodes to U+FFFD. OpenAI's API instead wants
each token's own UTF-8 bytes, and ``text_offset`` character positions into the returned text.
:class:`TokenPieces` derives the bytes from the token's vocabulary string:

* ``<0xAB>`` byte-fallback pieces are that byte;
* byte-level BPE vocabularies (GPT-2 / Llama-3 / Qwen2: decoder type ``ByteLevel``) map each
  character back to its byte through the inverse of the printable-byte table;
* otherwise the token is decoded after a fixed anchor token, and the anchor's text removed, so
  leading spaces survive.

CPU-only; uses the transformers tokenizer's public API.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Optional, Sequence

logger = logging.getLogger(__name__)

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _printable_byte_table() -> dict[str, int]:
    """Char -> byte of byte-level BPE vocabularies: printable Latin-1 bytes stand for themselves,
    the other 68 bytes are shifted to code points 256, 257, ... in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _decoder_spec(tokenizer: Any) -> dict:
    try:
        return json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except Exception:  # a slow tokenizer or an unusual backend: fall back to anchored decoding
        return {}


def _decoder_types(spec: dict) -> list[str]:
    if spec.get("type") == "Sequence":
        return [d.get("type", "") for d in spec.get("decoders", [])]
    return [spec.get("type", "")] if spec else []


class TokenPieces:
    """Per-token bytes and text of one tokenizer (cached per id).

    Args:
        tokenizer: a transformers tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", []) or [])
        spec = _decoder_spec(tokenizer)
        types = _decoder_types(spec)
        self.byte_level = "ByteLevel" in types
        self._table = _printable_byte_table() if self.byte_level else None
        # SentencePiece conversions strip one leading space at the start of a decode
        self.strips_leading_space = "Strip" in types
        self._anchor: Optional[list[int]] = None
        self._anchor_text = ""
        if not self.byte_level:
            ids = tokenizer.encode("a", add_special_tokens=False)
            if ids:
                self._anchor = [ids[0]]
                self._anchor_text = tokenizer.decode(self._anchor)
        self._cache: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        """The UTF-8 bytes token ``token_id`` contributes inside a sequence (a special token: its
        literal text, e.g. ``b"<s>"``)."""
        b = self._cache.get(token_id)
        if b is None:
            b = self._compute(token_id)
            self._cache[token_id] = b
        return b

    def _compute(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if token_id in self.special_ids or piece is None:
            return (piece or "").encode("utf-8")
        m = _BYTE_PIECE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if self._table is not None and all(c in self._table for c in piece):
            return bytes(self._table[c] for c in piece)
        if self._anchor is not None:
            text = self.tokenizer.decode(self._anchor + [token_id])
            if text.startswith(self._anchor_text):
                return text[len(self._anchor_text):].encode("utf-8")
        return self.tokenizer.decode([token_id]).encode("utf-8")

    def text_of(self, token_id: int) -> str:
        """The token's text (its bytes as UTF-8; a partial character shows as U+FFFD)."""
        return self.bytes_of(token_id).decode("utf-8", errors="replace")

    def offsets(self, token_ids: Sequence[int], start: int = 0, at_sequence_start: bool = False,
                skip_special: bool = True) -> list[int]:
        """Character offset of each token's start in the decoded text (OpenAI ``text_offset``).

        Args:
            token_ids: consecutive tokens of one text.
            start: the offset of the first token.
            at_sequence_start: the tokens start a decode (an echoed prompt): a leading space that
                the tokenizer strips there is not counted.
            skip_special: special tokens add no text (the returned text skips them).
        Returns:
            ``len(token_ids) + 1`` ints: each token's offset, then the end offset (where a following
            chunk starts); a token that completes a multi-byte character counts it.
        """
        out, acc = [], b""
        first = at_sequence_start and self.strips_leading_space
        for tid in token_ids:
            out.append(start + len(acc.decode("utf-8", errors="ignore")))
            if skip_special and tid in self.special_ids:
                continue
            b = self.bytes_of(tid)
            if first:
                b = b[1:] if b.startswith(b" ") else b
                first = False
            acc += b
        out.append(start + len(acc.decode("utf-8", errors="ignore")))
        return out
