"""The interface the interpreter calls on a backend."""

from __future__ import annotations

import logging
from typing import Any, Iterator, Optional, Sequence

from sglang.lang.chat_template import ChatTemplate, default_chat_template
from sglang.lang.choices import ChoicesDecision
from sglang.lang.ir import SglSamplingParams

logger = logging.getLogger(__name__)

STREAMED_LOGPROB_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
"""The ``meta_info`` lists with one entry per output token. :meth:`BaseBackend.generate_stream` yields them complete
(every token so far); ``ProgramState.text_async_iter(name, return_meta_data=True)`` cuts them to each chunk's new
tokens."""


class BaseBackend:
    """A backend runs a program's ``gen`` and ``select`` given its executor ``s``.

    ``s`` is a :class:`~sglang.lang.interpreter.StreamExecutor`: ``s.text_`` is the prompt so far,
    ``s.messages_`` the completed chat turns, ``s.cur_role`` the open role.
    """

    def get_chat_template(self) -> ChatTemplate:
        """How roles render (default: ``"{role}: {content}\\n"``)."""
        return default_chat_template()

    def cache_prefix(self, s: Any) -> None:
        """Hint that ``s.text_`` is a prefix several requests will share (no-op by default)."""

    def generate(self, s: Any, sampling_params: SglSamplingParams) -> tuple[str, dict[str, Any]]:
        """Generate a continuation of ``s``: returns (text, meta_info)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement gen")

    def generate_stream(self, s: Any, sampling_params: SglSamplingParams) -> Iterator[tuple[str, Optional[dict]]]:
        """Yield (new text, meta_info so far) while generating (default: one chunk from :meth:`generate`).

        A yielded meta_info's :data:`STREAMED_LOGPROB_KEYS` lists cover every output token so far, and its
        ``completion_tokens`` counts them."""
        yield self.generate(s, sampling_params)

    def select(self, s: Any, choices: Sequence[str], temperature: float, choices_method: Any) -> ChoicesDecision:
        """Choose one of ``choices`` as the continuation of ``s``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement select")

    def flush_cache(self) -> Any:
        """Drop the server's prefix cache (no-op by default)."""
        return None

    def get_server_info(self) -> dict[str, Any]:
        """Server information (empty by default)."""
        return {}

    def shutdown(self) -> None:
        """Release resources (no-op by default)."""
