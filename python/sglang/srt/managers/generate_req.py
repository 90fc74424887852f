"""The body of SGLang's ``POST /generate``, its validation and its expansion into single requests.

A :class:`GenerateReqInput` is what a client sends: one prompt or a batch of
prompts (``text`` or ``input_ids``), with per-prompt or shared sampling
parameters. :meth:`GenerateReqInput.normalize` checks every field and returns
one :class:`SingleGenerateReq` per sequence to generate: a batch of ``B``
prompts with ``n`` samples each becomes ``B * n`` single requests, ordered
prompt-major (output index ``i * n + j`` is sample ``j`` of prompt ``i``),
which is also the order of the response list.
"""

from __future__ import annotations

import copy
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Union

logger = logging.getLogger(__name__)

# SGLang fields that this fork does not implement: a non-null value is rejected, null is ignored.
_UNSUPPORTED_FIELDS = (
    "image_data", "audio_data", "video_data", "input_embeds", "lora_path", "lora_id",
    "return_hidden_states", "session_params",
)
_KNOWN_FIELDS = (
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "return_text_in_logprobs", "stream", "token_ids_logprob", "custom_logit_processor",
    "bootstrap_host", "bootstrap_port", "bootstrap_room",
)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_id_list(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(x) for x in v)


@dataclass
class SingleGenerateReq:
    """One sequence to generate (after batch and ``n`` expansion).

    Attributes:
        index: position of this request's output in the response list (0 for a single request).
        text / input_ids: exactly one is set; ``input_ids`` are token ids (ints).
        sampling_params: the request's sampling dict with ``n`` set to 1 (not yet type-checked:
            :class:`~sglang.srt.sampling.sampling_params.SamplingParams` does that).
        rid: unique request id. parent_rid: the rid the client gave (or generated) before
            ``n`` expansion; ``/abort_request`` with it aborts every sample.
    """

    index: int
    rid: str
    parent_rid: str
    text: Optional[str]
    input_ids: Optional[list[int]]
    sampling_params: dict[str, Any]
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    token_ids_logprob: Optional[list[int]] = None
    custom_logit_processor: Optional[str] = None
    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None
    bootstrap_room: Optional[int] = None


@dataclass
class GenerateReqInput:
    """SGLang's ``/generate`` request body.

    Attributes:
        text: a prompt (str) or a batch of prompts (list[str]).
        input_ids: token ids of one prompt (list[int]) or a batch (list[list[int]]).
        sampling_params: a dict shared by all prompts, or one dict per prompt.
        rid: request id (str) or one per prompt; generated when absent.
        return_logprob / logprob_start_len / top_logprobs_num: scalars or one per prompt.
            ``logprob_start_len`` -1 means no input-token logprobs.
        return_text_in_logprobs: add each token's text to logprob entries.
        stream: stream cumulative outputs.
        token_ids_logprob: token ids (list[int], or one list per prompt) whose logprobs are reported at
            every position (``meta_info.input_token_ids_logprobs`` / ``output_token_ids_logprobs``;
            needs ``return_logprob``).
        custom_logit_processor: a serialized custom logit processor (str, or one per prompt); only
            accepted with ``--enable-custom-logit-processor`` (checked by the TokenizerManager).

    The batch flag (:attr:`is_batch`) is set by :meth:`normalize`: true when the
    prompt is a list of prompts or when ``n`` > 1 (SGLang then answers with a list).
    """

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    rid: Optional[Union[str, list[str]]] = None
    return_logprob: Union[bool, list[bool]] = False
    logprob_start_len: Union[int, list[int]] = -1
    top_logprobs_num: Union[int, list[int]] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    token_ids_logprob: Optional[Union[list[int], list[list[int]]]] = None
    custom_logit_processor: Optional[Union[str, list[Optional[str]]]] = None
    # prefill/decode disaggregation (set by the mini_lb router): the prefill server's bootstrap address and the
    # room pairing the two halves; scalars or one per prompt. Samples j > 0 of n > 1 use derive_room(room, j).
    bootstrap_host: Optional[Union[str, list[str]]] = None
    bootstrap_port: Optional[Union[int, list[int]]] = None
    bootstrap_room: Optional[Union[int, list[int]]] = None
    is_batch: bool = field(default=False, init=False)

    @classmethod
    def from_dict(cls, body: Any) -> "GenerateReqInput":
        """Build from a parsed JSON body.

        Unknown keys are ignored (as SGLang's server does), except SGLang
        features this fork lacks (``image_data``, ``lora_path``, ...), which
        are rejected when not null.

        Raises:
            ValueError: ``body`` is not a JSON object, or sets an unsupported feature (named).
        """
        if not isinstance(body, dict):
            raise ValueError(f"the request body must be a JSON object, got {type(body).__name__}")
        for key in _UNSUPPORTED_FIELDS:
            if body.get(key) is not None:
                raise ValueError(f"{key} is not supported by this server; remove it from the request")
        unknown = [k for k in body if k not in _KNOWN_FIELDS and k not in _UNSUPPORTED_FIELDS]
        if unknown:
            logger.debug("ignoring unknown /generate fields %s", unknown)
        kwargs = {k: body[k] for k in _KNOWN_FIELDS if k in body and body[k] is not None}
        return cls(**kwargs)

    # ------------------------------------------------------------------ checks
    def _prompts(self) -> tuple[bool, list[Optional[str]], list[Optional[list[int]]]]:
        """Return (is_list, texts, ids) with one entry per prompt; raise ValueError on bad prompts."""
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text and input_ids must be given "
                             f"(got {'both' if self.text is not None else 'neither'})")
        if self.text is not None:
            if isinstance(self.text, str):
                if self.text == "":
                    raise ValueError("text must not be empty")
                return False, [self.text], [None]
            if not isinstance(self.text, list) or not all(isinstance(t, str) for t in self.text):
                raise ValueError(f"text must be a string or a list of strings, got {type(self.text).__name__}")
            if not self.text:
                raise ValueError("text must not be an empty list")
            for i, t in enumerate(self.text):
                if t == "":
                    raise ValueError(f"text[{i}] must not be empty")
            return True, list(self.text), [None] * len(self.text)
        ids = self.input_ids
        if not isinstance(ids, list):
            raise ValueError(f"input_ids must be a list of token ids or a list of such lists, got {type(ids).__name__}")
        if not ids:
            raise ValueError("input_ids must not be empty")
        if _is_id_list(ids):
            return False, [None], [list(ids)]
        if all(isinstance(x, list) for x in ids):
            for i, x in enumerate(ids):
                if not _is_id_list(x):
                    raise ValueError(f"input_ids[{i}] must be a list of integer token ids")
                if not x:
                    raise ValueError(f"input_ids[{i}] must not be empty")
            return True, [None] * len(ids), [list(x) for x in ids]
        raise ValueError("input_ids must be a list of integer token ids or a list of such lists")

    @staticmethod
    def _per_prompt(name: str, value: Any, size: int, check, expect: str) -> list[Any]:
        """Broadcast a scalar to ``size`` entries or check a list's length and entry types."""
        if isinstance(value, list):
            if len(value) != size:
                raise ValueError(f"{name} has {len(value)} entries but the batch has {size} prompts")
            values = value
        else:
            values = [value] * size
        for v in values:
            if not check(v):
                raise ValueError(f"{name} must be {expect} (or a list of those, one per prompt), got {v!r}")
        return list(values)

    def normalize(self) -> list[SingleGenerateReq]:
        """Validate the request and expand it into single requests.

        Returns:
            ``B * n`` :class:`SingleGenerateReq` (prompt-major). Each carries a copy of its
            sampling dict with ``n`` = 1; when the client gave a ``seed`` and ``n`` > 1,
            sample ``j`` gets ``seed + j`` so the samples differ yet stay reproducible
            (greedy samples are identical copies). Sets :attr:`is_batch`.

        Raises:
            ValueError: naming the field: both or neither of text/input_ids, an empty prompt,
                a wrong type, a per-prompt list whose length differs from the batch, ``n`` < 1,
                ``logprob_start_len`` < -1, ``top_logprobs_num`` < 0, duplicate ``rid``.
        """
        is_list, texts, ids = self._prompts()
        size = len(texts)
        sp = self.sampling_params if self.sampling_params is not None else {}
        if isinstance(sp, list):
            if not is_list:
                raise ValueError("sampling_params must be a JSON object for a single prompt, got a list")
            if len(sp) != size:
                raise ValueError(f"sampling_params has {len(sp)} entries but the batch has {size} prompts")
            sps = sp
        elif isinstance(sp, dict):
            sps = [sp] * size
        else:
            raise ValueError(f"sampling_params must be a JSON object (or a list of them), got {type(sp).__name__}")
        for p in sps:
            if not isinstance(p, dict):
                raise ValueError(f"sampling_params must be a JSON object (or a list of them), got {p!r}")

        if self.rid is None:
            rids = [uuid.uuid4().hex for _ in range(size)]
        else:
            rids = self._per_prompt("rid", self.rid, size, lambda v: isinstance(v, str) and v != "",
                                    "a non-empty string")
            if not isinstance(self.rid, list) and size > 1:
                raise ValueError("rid must be a list with one id per prompt for a batch request")
        if len(set(rids)) != len(rids):
            raise ValueError("rid must be unique within a batch")
        return_logprob = self._per_prompt("return_logprob", self.return_logprob, size,
                                          lambda v: isinstance(v, bool), "a boolean")
        start_lens = self._per_prompt("logprob_start_len", self.logprob_start_len, size,
                                      lambda v: _is_int(v) and v >= -1, "an integer >= -1")
        top_nums = self._per_prompt("top_logprobs_num", self.top_logprobs_num, size,
                                    lambda v: _is_int(v) and v >= 0, "an integer >= 0")
        if not isinstance(self.return_text_in_logprobs, bool):
            raise ValueError(f"return_text_in_logprobs must be a boolean, got {self.return_text_in_logprobs!r}")
        if not isinstance(self.stream, bool):
            raise ValueError(f"stream must be a boolean, got {self.stream!r}")
        tids = self.token_ids_logprob
        if tids is None or _is_id_list(tids):
            tid_lists = [list(tids) if tids is not None else None] * size
        elif isinstance(tids, list) and all(t is None or _is_id_list(t) for t in tids):
            tid_lists = self._per_prompt("token_ids_logprob", tids, size, lambda v: True, "")
        else:
            raise ValueError("token_ids_logprob must be a list of integer token ids (or one such list per prompt)")
        procs = self._per_prompt("custom_logit_processor", self.custom_logit_processor, size,
                                 lambda v: v is None or isinstance(v, str), "a string")

        hosts = self._per_prompt("bootstrap_host", self.bootstrap_host, size,
                                 lambda v: v is None or isinstance(v, str), "a host name")
        ports = self._per_prompt("bootstrap_port", self.bootstrap_port, size,
                                 lambda v: v is None or (_is_int(v) and 1 <= v <= 65535), "a TCP port in 1..65535")
        rooms = self._per_prompt("bootstrap_room", self.bootstrap_room, size,
                                 lambda v: v is None or (_is_int(v) and 0 <= v < (1 << 63)), "an integer in [0, 2**63)")
        if size > 1 and self.bootstrap_room is not None and not isinstance(self.bootstrap_room, list):
            raise ValueError("bootstrap_room must be a list with one room per prompt for a batch request")
        from sglang.srt.disaggregation.rooms import derive_room

        ns = []
        for p in sps:
            n = p.get("n", 1)
            if n is None:
                n = 1
            if isinstance(n, float) and n.is_integer():
                n = int(n)
            if not _is_int(n):
                raise ValueError(f"n must be an integer, got {n!r}")
            if n < 1:
                raise ValueError(f"n must be >= 1, got {n}")
            ns.append(n)

        out: list[SingleGenerateReq] = []
        for i in range(size):
            n = ns[i]
            for j in range(n):
                params = copy.deepcopy(sps[i])
                params["n"] = 1
                if n > 1 and _is_int(params.get("seed")):
                    params["seed"] = params["seed"] + j
                out.append(SingleGenerateReq(
                    index=len(out),
                    rid=rids[i] if n == 1 else f"{rids[i]}-{j}",
                    parent_rid=rids[i],
                    text=texts[i],
                    input_ids=list(ids[i]) if ids[i] is not None else None,
                    sampling_params=params,
                    return_logprob=return_logprob[i],
                    logprob_start_len=start_lens[i],
                    top_logprobs_num=top_nums[i],
                    return_text_in_logprobs=self.return_text_in_logprobs,
                    stream=self.stream,
                    token_ids_logprob=list(tid_lists[i]) if tid_lists[i] else None,
                    custom_logit_processor=procs[i],
                    bootstrap_host=hosts[i], bootstrap_port=ports[i],
                    bootstrap_room=None if rooms[i] is None else derive_room(rooms[i], j),
                ))
        self.is_batch = is_list or len(out) > 1
        return out
