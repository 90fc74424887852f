"""A running sglang server as a frontend backend, through its native ``/generate`` route."""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any, Iterator, Optional, Sequence, Union

from sglang.lang.backend.base_backend import STREAMED_LOGPROB_KEYS, BaseBackend
from sglang.lang.chat_template import (
    ChatTemplate,
    default_chat_template,
    from_template,
    from_tokenizer,
    get_chat_template_by_name,
)
from sglang.lang.choices import ChoicesDecision, mean_logprob, token_length_normalized
from sglang.lang.ir import SglSamplingParams

logger = logging.getLogger(__name__)

GREEDY_EPS = 1e-5
"""``select`` scores choices; a temperature above this is refused (as SGLang does)."""


class RuntimeEndpoint(BaseBackend):
    """Talk to an sglang server (``python -m sglang.launch_server``) at ``base_url``.

    Args:
        base_url: e.g. ``"http://127.0.0.1:30000"``.
        api_key: sent as ``Authorization: Bearer <api_key>`` (the server's ``--api-key``).
        verify: TLS verification for ``requests`` (a CA bundle path or bool); None = default.
        chat_template_name: a built-in template by SGLang's name (``"llama-3-instruct"``, ``"chatml"``,
            ``"qwen"``, ``"default"``; see :func:`~sglang.lang.chat_template.get_chat_template_by_name`).
        chat_template: how roles render: a :class:`~sglang.lang.chat_template.ChatTemplate`, a Jinja
            template string, or None to use the served model's template (see :meth:`get_chat_template`).
        timeout: per-request timeout in seconds (None: wait as long as generation takes).

    Raises:
        RuntimeError: the server cannot be reached or ``/get_model_info`` fails (checked at once).
        ValueError: a bad ``base_url``, an unknown ``chat_template_name``, or both template arguments.
    """

    def __init__(self, base_url: str, api_key: Optional[str] = None, verify: Any = None,
                 chat_template_name: Optional[str] = None, chat_template: Union[ChatTemplate, str, None] = None,
                 timeout: Optional[float] = None) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL such as 'http://127.0.0.1:30000', got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.verify = verify
        self.timeout = timeout
        self._local = threading.local()
        self._template_lock = threading.Lock()
        if chat_template_name is not None and chat_template is not None:
            raise ValueError("pass at most one of chat_template_name and chat_template")
        if chat_template_name is not None:
            chat_template = get_chat_template_by_name(chat_template_name)
        if isinstance(chat_template, str):
            chat_template = from_template(chat_template)
        self._chat_template: Optional[ChatTemplate] = chat_template
        self.model_info: dict[str, Any] = self._request("GET", "/get_model_info")

    # ----------------------------------------------------------------- http
    def _session(self):
        import requests

        sess = getattr(self._local, "session", None)
        if sess is None:
            sess = requests.Session()
            if self.api_key:
                sess.headers["Authorization"] = f"Bearer {self.api_key}"
            if self.verify is not None:
                sess.verify = self.verify
            self._local.session = sess
        return sess

    def _request(self, method: str, path: str, body: Any = None, stream: bool = False):
        """Send one request; return the parsed JSON (or the streaming response).

        Raises:
            ValueError: HTTP 400 (bad input), with the server's message.
            RuntimeError: the server is unreachable or answered another error status.
        """
        import requests

        url = self.base_url + path
        try:
            resp = self._session().request(method, url, json=body, stream=stream, timeout=self.timeout)
        except requests.RequestException as e:
            raise RuntimeError(f"cannot reach the sglang server at {url}: {e}") from e
        if resp.status_code != 200:
            try:
                err = resp.json()
                msg = err.get("error", {}).get("message") if isinstance(err.get("error"), dict) else None
                msg = msg or err.get("message") or err.get("detail") or resp.text
            except ValueError:
                msg = resp.text
            if resp.status_code == 400:
                raise ValueError(f"{path}: {msg}")
            raise RuntimeError(f"{method} {url} failed with HTTP {resp.status_code}: {msg}")
        return resp if stream else resp.json()

    # ----------------------------------------------------------- templates
    def get_chat_template(self) -> ChatTemplate:
        """The served model's chat template (loaded on first use).

        Uses, in order: the ``chat_template`` given to the constructor; a ``chat_template`` field of
        ``/get_model_info`` (with ``bos_token`` / ``eos_token``); the tokenizer at the server's
        ``tokenizer_path`` when it is a folder on this machine; else the default ``"{role}: ..."``.
        """
        with self._template_lock:
            if self._chat_template is None:
                self._chat_template = self._load_chat_template()
            return self._chat_template

    def _load_chat_template(self) -> ChatTemplate:
        info = self.model_info
        if "chat_template" in info:
            tmpl = info.get("chat_template")
            if not tmpl:
                return default_chat_template()
            strip = info.get("bos_token") if info.get("add_bos_token") else None
            return from_template(tmpl, {"bos_token": info.get("bos_token"), "eos_token": info.get("eos_token")},
                                 strip_prefix=strip, name=str(info.get("model_path", "server")))
        path = info.get("tokenizer_path") or info.get("model_path")
        if isinstance(path, str) and os.path.isdir(path):
            from transformers import AutoTokenizer

            return from_tokenizer(AutoTokenizer.from_pretrained(path))
        logger.warning("the server's /get_model_info has no chat_template and its tokenizer path %r is not a "
                       "local folder; roles use the default 'role: content' format", path)
        return default_chat_template()

    def _prompt(self, s: Any) -> str:
        text = s.text_
        tmpl = self._chat_template
        if tmpl is not None and tmpl.strip_prefix and text.startswith(tmpl.strip_prefix):
            text = text[len(tmpl.strip_prefix):]
        return text

    # ------------------------------------------------------------- generate
    def _generate_body(self, s: Any, params: SglSamplingParams) -> dict[str, Any]:
        return {"text": self._prompt(s), "sampling_params": params.to_srt_kwargs(), **params.to_logprob_kwargs()}

    def generate(self, s: Any, sampling_params: SglSamplingParams) -> tuple[str, dict[str, Any]]:
        """One ``/generate`` call on ``s.text_``; returns (text, meta_info)."""
        obj = self._request("POST", "/generate", self._generate_body(s, sampling_params))
        return obj["text"], obj["meta_info"]

    def generate_stream(self, s: Any, sampling_params: SglSamplingParams) -> Iterator[tuple[str, Optional[dict]]]:
        """Streaming ``/generate``; yields (new text, meta_info so far).

        The server streams cumulative chunks (its default: ``text``, ``output_ids`` and the per-output-token
        logprob lists so far) or deltas (``--incremental-streaming-output``); each chunk is read by its own shape:
        after the first, a chunk whose ``output_ids`` hold exactly the ``completion_tokens`` added since the previous
        chunk is a delta, one holding all of them is cumulative. ``output_token_logprobs_length`` places each chunk's
        logprob lists, so the yielded text is always the new text and each yielded meta_info holds the full lists
        so far either way.

        Raises:
            ValueError / RuntimeError: the server rejected the request or reported an error mid-stream.
        """
        body = {**self._generate_body(s, sampling_params), "stream": True}
        resp = self._request("POST", "/generate", body, stream=True)
        text_so_far = ""
        tokens_so_far = 0
        acc: dict[str, list] = {}
        try:
            for line in resp.iter_lines():
                if not line or not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                obj = json.loads(payload)
                if "error" in obj:
                    err = obj["error"]
                    raise RuntimeError(f"/generate failed while streaming: "
                                       f"{err.get('message') if isinstance(err, dict) else err}")
                text = obj.get("text") or ""
                meta = obj.get("meta_info")
                total = meta.get("completion_tokens") if isinstance(meta, dict) else None
                ids = obj.get("output_ids")
                is_delta = (tokens_so_far > 0 and isinstance(ids, list) and isinstance(total, int)
                            and len(ids) == total - tokens_so_far)
                delta = text if is_delta else text[len(text_so_far):]
                text_so_far = text_so_far + text if is_delta else text
                if isinstance(total, int):
                    tokens_so_far = total
                if isinstance(meta, dict) and "output_token_logprobs_length" in meta:
                    # a cumulative list (offset 0, the server's default) replaces; a delta is placed at its offset
                    length = meta["output_token_logprobs_length"]
                    for key in STREAMED_LOGPROB_KEYS:
                        if key in meta:
                            offset = max(length - len(meta[key]), 0)
                            acc[key] = acc.get(key, [])[:offset] + list(meta[key])
                            meta[key] = list(acc[key])
                yield delta, meta
        finally:
            resp.close()

    def cache_prefix(self, s: Any) -> None:
        """Prefill ``s.text_`` once (``max_new_tokens=0``) so that later requests share its KV."""
        text = self._prompt(s)
        if text:
            self._request("POST", "/generate", {"text": text, "sampling_params": {"max_new_tokens": 0}})

    # --------------------------------------------------------------- select
    def select(self, s: Any, choices: Sequence[str], temperature: float, choices_method: Any) -> ChoicesDecision:
        """Score every choice as the continuation of ``s.text_`` and let ``choices_method`` decide.

        1. Prefill the prefix (``max_new_tokens=0``) to learn its token count ``P`` and cache its KV.
        2. One batch ``/generate`` of ``prefix`` and ``prefix + choice`` for all choices with
           ``return_logprob=True, logprob_start_len=P-1, max_new_tokens=0``: the input logprobs of the
           last prefix position and of every choice token (the prefix's own entry gives the id of its
           last token).
        3. Token healing: if a choice's token at position ``P-1`` is still the prefix's last token the
           boundary did not move and that (prefix) entry is dropped; otherwise the prefix's last
           token merged with the choice's first characters and the merged token is scored as part
           of the choice (SGLang compares token texts; comparing ids is exact).
        4. For :data:`~sglang.lang.choices.unconditional_likelihood_normalized`, score each choice's
           tokens again alone (``input_ids``, no prompt).

        Raises:
            ValueError: ``choices`` is empty or ``temperature`` > 0 (select is greedy).
        """
        if not choices:
            raise ValueError("select needs at least one choice")
        if temperature > GREEDY_EPS:
            raise ValueError(f"select scores choices greedily; temperature must be 0, got {temperature}")
        choices_method = choices_method or token_length_normalized
        prefix = self._prompt(s)
        start = 0
        if prefix:
            obj = self._request("POST", "/generate", {"text": prefix, "sampling_params": {"max_new_tokens": 0}})
            start = max(int(obj["meta_info"]["prompt_tokens"]) - 1, 0)
        texts = ([prefix] if prefix else []) + [prefix + c for c in choices]
        body = {"text": texts, "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": start}
        objs = self._request("POST", "/generate", body)
        boundary_id = None
        if prefix:
            prefix_entries = objs[0]["meta_info"]["input_token_logprobs"]
            boundary_id = prefix_entries[0][1] if prefix_entries else None
            objs = objs[1:]
        input_lps, output_lps, normalized = [], [], []
        for obj in objs:
            entries = [list(e) for e in obj["meta_info"]["input_token_logprobs"]]
            if boundary_id is not None and entries and entries[0][1] == boundary_id:
                entries = entries[1:]  # no healing: the boundary token is the prefix's own last token
            entries = [e for e in entries if e[0] is not None]
            input_lps.append(entries)
            output_lps.append(obj["meta_info"].get("output_token_logprobs"))
            normalized.append(mean_logprob(entries))
        uncond = None
        if getattr(choices_method, "requires_unconditional_logprobs", False):
            uncond = self._unconditional_logprobs(input_lps)
        return choices_method(choices=list(choices), normalized_prompt_logprobs=normalized,
                              input_token_logprobs=input_lps, output_token_logprobs=output_lps,
                              unconditional_token_logprobs=uncond)

    def _unconditional_logprobs(self, input_lps: list[list[list[Any]]]) -> list[list[list[Any]]]:
        """Logprobs of each choice's scored tokens with no prompt before them (first one: None)."""
        ids = [[e[1] for e in entries] for entries in input_lps]
        todo = [i for i, x in enumerate(ids) if x]
        out: list[list[list[Any]]] = [[] for _ in ids]
        if todo:
            objs = self._request("POST", "/generate", {
                "input_ids": [ids[i] for i in todo], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "return_logprob": True, "logprob_start_len": 0})
            for i, obj in zip(todo, objs):
                out[i] = [list(e) for e in obj["meta_info"]["input_token_logprobs"]]
        return out

    # ---------------------------------------------------------------- admin
    def flush_cache(self) -> dict[str, Any]:
        """``POST /flush_cache``.

        Raises:
            ValueError: the server refused (requests are running).
        """
        return self._request("POST", "/flush_cache")

    def get_server_info(self) -> dict[str, Any]:
        """``GET /get_server_info``."""
        return self._request("GET", "/get_server_info")

    def get_model_name(self) -> str:
        """The served model's path."""
        return str(self.model_info.get("model_path", ""))
