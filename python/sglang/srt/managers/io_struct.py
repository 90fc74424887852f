"""Typed messages exchanged between the server's processes over ZMQ.

Every message is a ``msgspec.Struct`` tagged with its class name, so one
decoder (:func:`decode_msg`) recovers the right type from msgpack bytes.
Nothing here is ever pickled: the sockets could face a network.

Process graph (see docs/architecture.md)::

    TokenizerManager --TokenizedGenerateReqInput/AbortReq/control--> Scheduler
    Scheduler --BatchTokenIDOut--> DetokenizerManager --BatchStrOut--> TokenizerManager
    Scheduler --control outputs / SchedulerStats--> TokenizerManager

Finish reasons are plain dicts, as SGLang reports them in ``meta_info``:
``{"type": "stop", "matched": <token id or stop string>}``,
``{"type": "length", "length": <max_new_tokens>}`` or
``{"type": "abort", "message": <why>, "status_code": <http code>}``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec


class TokenizedGenerateReqInput(msgspec.Struct, tag=True):
    """One tokenized request, TokenizerManager -> Scheduler.

    ``sampling_params`` is :meth:`SamplingParams.to_dict` output (validated
    and normalized by the TokenizerManager). ``logprob_start_len`` = -1 means
    no input logprobs; otherwise input-token logprobs are returned from that
    prompt position on.
    """

    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]
    input_text: Optional[str] = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    created_time: float = 0.0
    token_ids_logprob: Optional[list[int]] = None  # ids whose logprobs are reported at every output position
    custom_logit_processor: Optional[str] = None  # serialized processor (only with --enable-custom-logit-processor)
    # prefill/decode disaggregation (SGLang's request fields; None on an aggregated server)
    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None
    bootstrap_room: Optional[int] = None


class AbortReq(msgspec.Struct, tag=True):
    """Abort one request (``rid``) or all of them (``abort_all``); its KV is freed at once."""

    rid: str = ""
    abort_all: bool = False


class WakeUpReq(msgspec.Struct, tag=True):
    """DP attention: the front end sent a request to another data-parallel scheduler; this one leaves its idle wait
    at once (the ranks step together) instead of at its next poll timeout. Carries nothing; handling it is a no-op."""


class FlushCacheReqInput(msgspec.Struct, tag=True):
    """Ask the scheduler to drop the prefix cache (only succeeds when idle).

    ``dp_rank``: which data-parallel scheduler (AFD attention worker) it is sent to; ``seq``: the asking round
    (a reply that comes after its round timed out is not taken for a later round's). Both are echoed in the reply.
    """

    dp_rank: int = 0
    seq: int = 0


class FlushCacheReqOutput(msgspec.Struct, tag=True):
    """Reply to :class:`FlushCacheReqInput`; ``message`` says why it was refused; ``dp_rank``, ``seq`` echo the
    request's."""

    success: bool
    message: str = ""
    dp_rank: int = 0
    seq: int = 0


class GetInternalStateReq(msgspec.Struct, tag=True):
    """Ask the scheduler for its state (KV usage, queue lengths, limits); ``dp_rank``, ``seq`` as in
    :class:`FlushCacheReqInput`."""

    dp_rank: int = 0
    seq: int = 0


class GetInternalStateReqOutput(msgspec.Struct, tag=True):
    """Reply to :class:`GetInternalStateReq`: KV usage, queue lengths and limits (see ``Scheduler.internal_state``);
    ``dp_rank``, ``seq`` echo the request's."""

    state: dict[str, Any]
    dp_rank: int = 0
    seq: int = 0


class SchedulerStats(msgspec.Struct, tag=True):
    """Periodic gauges, Scheduler -> TokenizerManager, for ``/metrics``.

    ``token_usage`` is the fraction (0..1) of KV slots held by requests or the
    prefix cache; ``cache_hit_rate`` is cached/total prompt tokens since start.
    """

    num_running_reqs: int
    num_queue_reqs: int
    token_usage: float
    used_tokens: int
    max_total_tokens: int
    cache_hit_rate: float
    gen_throughput: float = 0.0


class BatchTokenIDOut(msgspec.Struct, tag=True):
    """New tokens of several requests after a step, Scheduler -> Detokenizer.

    All lists are indexed by request (same order as ``rids``).
    ``output_ids`` holds only the ids produced since the previous message
    for that request (a delta). ``finished_reasons[i]`` is None while the
    request runs. Logprob lists are deltas too: entries are
    ``(logprob, token_id)``; top-logprob entries are lists of those.
    ``input_token_logprobs``/``input_top_logprobs`` are sent once, with the
    first message of a request that asked for them, else None.
    ``decode_prefix_ids[i]`` (first message of a request only) holds the last
    few prompt tokens, the context the detokenizer decodes the output against
    (so SentencePiece vocabularies keep the first word's leading space, as in
    SGLang). ``stop_regexes[i]``: the request's ``stop_regex`` patterns (the
    detokenizer trims at a matched one). ``output_token_ids_logprobs`` /
    ``input_token_ids_logprobs``: per position, ``(logprob or None, id)`` for the
    request's ``token_ids_logprob`` ids (deltas / sent once, like the others).
    """

    rids: list[str]
    finished_reasons: list[Optional[dict[str, Any]]]
    output_ids: list[list[int]]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]
    stop_strs: list[list[str]]
    output_token_logprobs: Optional[list[Optional[list[tuple[float, int]]]]] = None
    output_top_logprobs: Optional[list[Optional[list[list[tuple[float, int]]]]]] = None
    input_token_logprobs: Optional[list[Optional[list[tuple[Optional[float], int]]]]] = None
    input_top_logprobs: Optional[list[Optional[list[list[tuple[float, int]]]]]] = None
    decode_prefix_ids: Optional[list[Optional[list[int]]]] = None
    stop_regexes: Optional[list[list[str]]] = None
    output_token_ids_logprobs: Optional[list[Optional[list[list[tuple[Optional[float], int]]]]]] = None
    input_token_ids_logprobs: Optional[list[Optional[list[list[tuple[Optional[float], int]]]]]] = None
    disagg_info: Optional[list[Optional[dict[str, Any]]]] = None  # disaggregated servers: transfer facts


class BatchStrOut(msgspec.Struct, tag=True):
    """Detokenized deltas of several requests, Detokenizer -> TokenizerManager.

    ``output_strs[i]`` is the new text since the last message for request i:
    never a broken UTF-8 sequence, never (unless ``no_stop_trim``) any part of
    a matched stop string, and never a suffix that may still become one.
    The other fields are forwarded from :class:`BatchTokenIDOut`.
    """

    rids: list[str]
    finished_reasons: list[Optional[dict[str, Any]]]
    output_strs: list[str]
    output_ids: list[list[int]]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    output_token_logprobs: Optional[list[Optional[list[tuple[float, int]]]]] = None
    output_top_logprobs: Optional[list[Optional[list[list[tuple[float, int]]]]]] = None
    input_token_logprobs: Optional[list[Optional[list[tuple[Optional[float], int]]]]] = None
    input_top_logprobs: Optional[list[Optional[list[list[tuple[float, int]]]]]] = None
    output_token_ids_logprobs: Optional[list[Optional[list[list[tuple[Optional[float], int]]]]]] = None
    input_token_ids_logprobs: Optional[list[Optional[list[list[tuple[Optional[float], int]]]]]] = None
    disagg_info: Optional[list[Optional[dict[str, Any]]]] = None


Message = Union[
    TokenizedGenerateReqInput,
    AbortReq,
    WakeUpReq,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    SchedulerStats,
    BatchTokenIDOut,
    BatchStrOut,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode_msg(msg: Message) -> bytes:
    """Serialize one message to msgpack bytes (tagged with its type name)."""
    return _encoder.encode(msg)


def decode_msg(data: bytes) -> Message:
    """Deserialize bytes from :func:`encode_msg`.

    Raises:
        msgspec.ValidationError / msgspec.DecodeError: the bytes are not a
            well-formed message of a known type.
    """
    return _decoder.decode(data)
