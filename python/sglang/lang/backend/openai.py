"""Any OpenAI-compatible API as a frontend backend, through the official ``openai`` client.

Chat models (``is_chat_model=True``) receive the program's completed chat turns
(``s.messages_``) and therefore need every ``gen`` right at the start of an ``assistant`` turn;
completion models receive the program's text (``s.text_``).

``select`` cannot be scored here: OpenAI-compatible APIs do not return the logprobs of prompt
tokens, which SGLang's scoring needs. It is implemented as greedy decoding constrained to the
choices with SGLang's ``regex`` extension field (``extra_body``), which works against sglang
servers with constrained decoding; APIs without that extension raise NotImplementedError.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Iterator, Optional, Sequence

from sglang.lang.backend.base_backend import BaseBackend
from sglang.lang.choices import ChoicesDecision, token_length_normalized
from sglang.lang.ir import SglSamplingParams

logger = logging.getLogger(__name__)

_COMPLETION_ONLY_PREFIXES = ("gpt-3.5-turbo-instruct", "davinci", "babbage")


class OpenAI(BaseBackend):
    """An OpenAI-compatible endpoint.

    Args:
        model_name: the ``model`` field of requests.
        is_chat_model: use ``/chat/completions`` (True) or ``/completions`` (False); None infers it
            from the name (completion-only OpenAI models: ``gpt-3.5-turbo-instruct``, ``davinci``, ...).
        base_url: e.g. ``"http://127.0.0.1:30000/v1"`` (None: the client's default, OpenAI's API).
        api_key: the API key (None: the client reads ``OPENAI_API_KEY``; a placeholder is used for
            local servers without one).
        **client_kwargs: passed to ``openai.OpenAI`` (timeout, max_retries, ...).
    """

    def __init__(self, model_name: str, is_chat_model: Optional[bool] = None, base_url: Optional[str] = None,
                 api_key: Optional[str] = None, **client_kwargs: Any) -> None:
        import os

        import openai

        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"model_name must be a non-empty string, got {model_name!r}")
        if api_key is None and not os.environ.get("OPENAI_API_KEY") and base_url is not None:
            api_key = "EMPTY"
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, **client_kwargs)
        self.model_name = model_name
        self.is_chat_model = (not model_name.startswith(_COMPLETION_ONLY_PREFIXES)
                              if is_chat_model is None else bool(is_chat_model))

    # ----------------------------------------------------------- requests
    @staticmethod
    def _kwargs(params: SglSamplingParams) -> dict[str, Any]:
        kw: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p,
                              "frequency_penalty": params.frequency_penalty,
                              "presence_penalty": params.presence_penalty}
        if params.max_new_tokens is not None:
            kw["max_tokens"] = params.max_new_tokens
        if params.stop_list():
            kw["stop"] = params.stop_list()
        extra: dict[str, Any] = {}
        if params.top_k != -1:
            extra["top_k"] = params.top_k
        if params.min_p:
            extra["min_p"] = params.min_p
        if params.ignore_eos:
            extra["ignore_eos"] = True
        if params.stop_token_ids:
            extra["stop_token_ids"] = list(params.stop_token_ids)
        if params.regex is not None:
            extra["regex"] = params.regex
        if params.json_schema is not None:
            extra["json_schema"] = params.json_schema
        if extra:
            kw["extra_body"] = extra
        return kw

    def _chat_messages(self, s: Any) -> list[dict[str, Any]]:
        if s.cur_role != "assistant" or s.text_[s.cur_role_begin_pos:] != "":
            raise ValueError("with an OpenAI chat model, sgl.gen/select must come right at the start of an "
                             "assistant turn (e.g. s += sgl.assistant(sgl.gen('answer'))); use "
                             "is_chat_model=False for a completion model")
        if not s.messages_:
            raise ValueError("an OpenAI chat model needs at least one completed turn (e.g. sgl.user(...)) "
                             "before the assistant's gen")
        return [dict(m) for m in s.messages_]

    @staticmethod
    def _meta(resp: Any) -> dict[str, Any]:
        choice = resp.choices[0]
        usage = getattr(resp, "usage", None)
        return {"id": resp.id, "finish_reason": choice.finish_reason,
                "prompt_tokens": getattr(usage, "prompt_tokens", None),
                "completion_tokens": getattr(usage, "completion_tokens", None)}

    def generate(self, s: Any, sampling_params: SglSamplingParams) -> tuple[str, dict[str, Any]]:
        """One chat or completion request; returns (text, meta_info with id/finish_reason/token counts)."""
        kw = self._kwargs(sampling_params)
        if self.is_chat_model:
            resp = self.client.chat.completions.create(model=self.model_name, messages=self._chat_messages(s), **kw)
            return resp.choices[0].message.content or "", self._meta(resp)
        resp = self.client.completions.create(model=self.model_name, prompt=s.text_, **kw)
        return resp.choices[0].text, self._meta(resp)

    def generate_stream(self, s: Any, sampling_params: SglSamplingParams) -> Iterator[tuple[str, Optional[dict]]]:
        """Streaming chat or completion; yields (new text, {"finish_reason"} once known)."""
        kw = self._kwargs(sampling_params)
        if self.is_chat_model:
            stream = self.client.chat.completions.create(model=self.model_name, messages=self._chat_messages(s),
                                                         stream=True, **kw)
        else:
            stream = self.client.completions.create(model=self.model_name, prompt=s.text_, stream=True, **kw)
        meta: dict[str, Any] = {}
        for chunk in stream:
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            text = (c.delta.content or "") if self.is_chat_model else (c.text or "")
            if c.finish_reason is not None:
                meta = {"id": chunk.id, "finish_reason": c.finish_reason}
            yield text, meta or None

    # ------------------------------------------------------------- select
    def select(self, s: Any, choices: Sequence[str], temperature: float, choices_method: Any) -> ChoicesDecision:
        """Greedy decoding constrained (SGLang's ``regex`` extension) to exactly one of ``choices``.

        Raises:
            ValueError: no choices.
            NotImplementedError: a ``choices_method`` other than the default (no scores exist here),
                or the API does not support the ``regex`` extension.
        """
        import openai

        if not choices:
            raise ValueError("select needs at least one choice")
        if choices_method not in (None, token_length_normalized):
            raise NotImplementedError(
                f"the OpenAI backend cannot apply choices_method={choices_method!r}: OpenAI-compatible APIs do "
                "not return prompt-token logprobs, so choices cannot be scored; use sgl.RuntimeEndpoint")
        pattern = "(" + "|".join(re.escape(c) for c in choices) + ")"
        params = SglSamplingParams(max_new_tokens=max(len(c) for c in choices) + 16, temperature=0.0,
                                   regex=pattern)
        try:
            text, meta = self.generate(s, params)
        except openai.BadRequestError as e:
            raise NotImplementedError(
                "select on an OpenAI-compatible API needs SGLang's 'regex' extension (constrained decoding), "
                f"which this API rejected ({e}); OpenAI APIs return no prompt logprobs to score choices with, "
                "so use sgl.RuntimeEndpoint for select") from e
        if text not in choices:
            raise NotImplementedError(
                f"the API ignored the regex constraint (generated {text!r}, not one of {list(choices)}); "
                "select needs constrained decoding or prompt logprobs, so use sgl.RuntimeEndpoint")
        return ChoicesDecision(text, {"method": "regex_constrained_greedy", **meta})

    def get_model_name(self) -> str:
        """The OpenAI model name requests are sent with."""
        return self.model_name
