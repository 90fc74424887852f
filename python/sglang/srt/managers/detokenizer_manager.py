"""The detokenizer process: token id deltas in, text deltas out.

``DetokenizerManager`` pulls :class:`BatchTokenIDOut` from the scheduler, keeps one
:class:`IncrementalDetokenizer` per running request, and pushes :class:`BatchStrOut` to the
TokenizerManager. Text deltas never end inside a multi-byte character, never contain a matched stop
string (unless ``no_stop_trim``), and never contain a suffix that may still grow into one.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from typing import Any, Optional

import zmq

from sglang.srt.managers.backend_tokenizer import BackendTokenizerSpec
from sglang.srt.managers.io_struct import BatchStrOut, BatchTokenIDOut, decode_msg, encode_msg
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.srt.utils.common import configure_logger, get_tokenizer, get_zmq_socket

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
MAX_LIVE_REQUESTS = 1 << 16
"""Decode states kept at most; beyond this the oldest are dropped (requests lost without a finish)."""


def stop_prefix_suffix_len(text: str, stop_strs: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a prefix of (or equal to) some stop string."""
    best = 0
    for s in stop_strs:
        for k in range(min(len(s), len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def regex_partial_hold(text: str, patterns: list[str]) -> int:
    """Length of the suffix of ``text`` to hold back because it is (the start of) a possible match
    of one of the ``stop_regex`` patterns that more text could complete (partial matching of the
    ``regex`` package; a pattern it cannot parse holds nothing)."""
    import regex

    best = 0
    for p in patterns:
        try:
            m = regex.search(p, text, partial=True, timeout=0.1)
        except (regex.error, RecursionError, OverflowError, TimeoutError):
            continue
        if m is not None and m.partial:
            best = max(best, len(text) - m.start())
    return best


class IncrementalDetokenizer:
    """Incremental detokenization of one request (SGLang's ``DecodeStatus``).

    Uses the prefix-offset / read-offset scheme (as in HF TGI and vLLM): ``ids[prefix:read]`` is a few
    already-emitted tokens of context, so decoding ``ids[prefix:]`` keeps word-initial spaces of
    SentencePiece vocabularies; the text beyond the context is confirmed only when it does not end in
    U+FFFD (a multi-byte character split over tokens), otherwise the ids wait for the next delta.
    Confirmed text then passes a stop-string filter (see :meth:`step`).

    Args:
        tokenizer: HF tokenizer with ``decode(ids, skip_special_tokens=, spaces_between_special_tokens=)``.
        skip_special_tokens / spaces_between_special_tokens: passed to ``decode``.
        no_stop_trim: keep matched stop strings / stop token text in the output.
        stop_strs: the request's stop strings (may be empty).
        prefix_ids: context tokens (the prompt's tail) decoded before the output but never
            emitted, so the first output token keeps its word-initial space.
        stop_regexes: the request's ``stop_regex`` patterns; while running, a suffix that may still grow
            into a match is held back (:func:`regex_partial_hold`); when the finish reason's ``matched``
            is one of them, the text is cut where the pattern's first match starts.
    """

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        no_stop_trim: bool = False,
        stop_strs: Optional[list[str]] = None,
        prefix_ids: Optional[list[int]] = None,
        stop_regexes: Optional[list[str]] = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.no_stop_trim = no_stop_trim
        self.stop_strs = list(stop_strs or [])
        self.stop_regexes = list(stop_regexes or [])
        self.ids: list[int] = list(prefix_ids or [])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.decoded_text = ""  # confirmed text: only grows
        self.sent_offset = 0  # characters of decoded_text already emitted
        self.finished = False
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", None) or ())

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def _is_byte_fallback(self, token_id: int) -> bool:
        """Whether ``token_id`` is a SentencePiece byte-fallback piece (``<0xNN>``), or a special token
        that decoding skips (transparent between two byte pieces)."""
        if self.skip_special_tokens and token_id in self._special_ids:
            return True
        convert = getattr(self.tokenizer, "convert_ids_to_tokens", None)
        if convert is None:
            return False
        piece = convert(token_id)
        return isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")

    def _stable_end(self, end: int) -> int:
        """End of the part of ``ids[:end]`` whose text can no longer change when more ids come.

        HF's ``ByteFallback`` decoder decodes a whole run of ``<0xNN>`` pieces at once and, when the run
        is not valid UTF-8, replaces *every* byte of it by U+FFFD, so a run that decodes cleanly now may
        turn into U+FFFDs when a later byte piece joins it. A trailing run of byte pieces is therefore
        held back until a non-byte piece ends it (or the request finishes).
        """
        stable = end
        while stable > self.read_offset and self._is_byte_fallback(self.ids[stable - 1]):
            stable -= 1
        return stable

    def _advance(self, final: bool) -> None:
        """Move newly decodable text of ``ids[read_offset:]`` into ``decoded_text``.

        The concatenated text equals the one-shot decode ``decode(prefix_ids + ids)`` past the prefix,
        whatever the chunking: confirmation points never fall inside a run of byte-fallback pieces
        (:meth:`_stable_end`) nor after a trailing partial character (U+FFFD at the end, see
        :meth:`_advance_to`), and at both kinds of points the decoders (``ByteFallback`` runs,
        ``ByteLevel``'s lossy UTF-8) are prefix-stable.
        """
        end = len(self.ids) if final else self._stable_end(len(self.ids))
        self._advance_to(end, final)

    def _advance_to(self, end: int, final: bool) -> None:
        """:meth:`_advance` over ``ids[:end]`` only."""
        if self.read_offset >= end:
            return
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:end])
        complete = len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR)
        if complete or final:
            # At the end a dangling partial character is flushed as U+FFFD, like a full decode.
            self.decoded_text += new_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = end

    def _stop_cut(self, stop: str) -> int:
        """Index in decoded_text where output must end for the matched stop string (or stop_regex) ``stop``."""
        if stop in self.stop_regexes and stop not in self.stop_strs:
            import regex

            try:
                m = regex.search(stop, self.decoded_text, timeout=0.5)
            except (regex.error, TimeoutError):
                m = None
            if m is None:
                logger.debug("matched stop_regex %r not found in the decoded text; not trimming", stop)
                return len(self.decoded_text)
            return max(m.start(), self.sent_offset)
        pos = self.decoded_text.find(stop, max(0, self.sent_offset - len(stop) + 1))
        if pos < 0:
            logger.debug("matched stop string %r not found in the decoded text; not trimming", stop)
            return len(self.decoded_text)
        return max(pos, self.sent_offset)

    def step(self, new_ids: list[int], finished_reason: Optional[dict[str, Any]] = None) -> str:
        """Add new token ids; return the text that may be shown now.

        While running, the longest not-yet-emitted suffix that is a prefix of a stop string is held
        back. When finished (``finished_reason`` not None) everything is flushed except, unless
        ``no_stop_trim``: the matched stop string and what follows it, or the matched stop token
        (dropped when it is the last new id).

        Args:
            new_ids: token ids produced since the previous call.
            finished_reason: None while running, else SGLang's finish-reason dict.
        Returns:
            The text delta (may be empty).
        """
        if self.finished:
            logger.debug("ignoring %d ids for an already finished request", len(new_ids))
            return ""
        matched = None
        if finished_reason is not None and finished_reason.get("type") == "stop":
            matched = finished_reason.get("matched")
        ids = list(new_ids)
        if isinstance(matched, int) and not self.no_stop_trim and ids and ids[-1] == matched:
            ids = ids[:-1]
        self.ids.extend(ids)
        final = finished_reason is not None
        self._advance(final)
        if final:
            self.finished = True
            end = len(self.decoded_text)
            if isinstance(matched, str) and not self.no_stop_trim:
                end = self._stop_cut(matched)
        else:
            pending = self.decoded_text[self.sent_offset:]
            hold = 0 if self.no_stop_trim else stop_prefix_suffix_len(pending, self.stop_strs)
            if self.stop_regexes and not self.no_stop_trim:
                hold = max(hold, regex_partial_hold(pending, self.stop_regexes))
            end = len(self.decoded_text) - hold
        out = self.decoded_text[self.sent_offset:end]
        self.sent_offset = max(self.sent_offset, end)
        return out


DecodeStatus = IncrementalDetokenizer
"""SGLang's name for the per-request state."""


class DetokenizerManager:
    """Turns :class:`BatchTokenIDOut` into :class:`BatchStrOut`; runs in its own process.

    Sockets: PULL bound on ``port_args.detokenizer_ipc``, PUSH connected to ``port_args.tokenizer_ipc``.
    Any other message type is forwarded unchanged (same bytes) to the TokenizerManager.

    Args:
        server_args: uses ``resolved_tokenizer_path``, ``trust_remote_code``, ``skip_tokenizer_init``
            (then every output string is "").
        port_args: the IPC endpoints.
        parent_watch: the launcher's :class:`~sglang.srt.entrypoints.worker_launcher.ParentWatch`;
            :meth:`event_loop` returns once it reports the launcher gone (None: never).
        poll_interval_s: how often the loop checks for stop requests and parent liveness.
        tokenizer_spec: the front end's tokenizer as a
            :class:`~sglang.srt.managers.backend_tokenizer.BackendTokenizerSpec` (decoding then needs neither
            transformers nor torch); None: load the HF tokenizer from ``server_args``.
    Raises:
        ValueError: the tokenizer cannot be loaded.
    """

    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs,
        parent_watch: Any = None,
        poll_interval_s: float = 1.0,
        tokenizer_spec: Optional[BackendTokenizerSpec] = None,
    ) -> None:
        self.server_args = server_args
        if server_args.skip_tokenizer_init:
            self.tokenizer = None
        elif tokenizer_spec is not None:
            self.tokenizer = tokenizer_spec.load()
        else:
            self.tokenizer = get_tokenizer(server_args.resolved_tokenizer_path, server_args.trust_remote_code)
        self.parent_watch = parent_watch
        self.poll_interval_s = poll_interval_s
        self.decode_status: dict[str, IncrementalDetokenizer] = {}
        self._stop_event = threading.Event()
        self._context = zmq.Context(1)
        self.recv_from_scheduler = get_zmq_socket(self._context, zmq.PULL, port_args.detokenizer_ipc, bind=True)
        self.send_to_tokenizer = get_zmq_socket(self._context, zmq.PUSH, port_args.tokenizer_ipc, bind=False)

    # ------------------------------------------------------------ handling
    def _status(self, rid: str, msg: BatchTokenIDOut, i: int) -> IncrementalDetokenizer:
        st = self.decode_status.get(rid)
        if st is None:
            if len(self.decode_status) >= MAX_LIVE_REQUESTS:
                oldest = next(iter(self.decode_status))
                logger.warning("more than %d live requests; dropping decode state of %s", MAX_LIVE_REQUESTS, oldest)
                del self.decode_status[oldest]
            st = IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=msg.skip_special_tokens[i],
                spaces_between_special_tokens=msg.spaces_between_special_tokens[i],
                no_stop_trim=msg.no_stop_trim[i],
                stop_strs=msg.stop_strs[i],
                prefix_ids=msg.decode_prefix_ids[i] if msg.decode_prefix_ids else None,
                stop_regexes=msg.stop_regexes[i] if msg.stop_regexes else None,
            )
            self.decode_status[rid] = st
        return st

    def handle_batch_token_id_out(self, msg: BatchTokenIDOut) -> BatchStrOut:
        """Detokenize one batch of deltas; per-request state is dropped when a request finishes."""
        output_strs: list[str] = []
        for i, rid in enumerate(msg.rids):
            finished = msg.finished_reasons[i]
            if self.tokenizer is None:
                output_strs.append("")
                continue
            output_strs.append(self._status(rid, msg, i).step(msg.output_ids[i], finished))
            if finished is not None:
                self.decode_status.pop(rid, None)
        return BatchStrOut(
            rids=msg.rids,
            finished_reasons=msg.finished_reasons,
            output_strs=output_strs,
            output_ids=msg.output_ids,
            prompt_tokens=msg.prompt_tokens,
            completion_tokens=msg.completion_tokens,
            cached_tokens=msg.cached_tokens,
            output_token_logprobs=msg.output_token_logprobs,
            output_top_logprobs=msg.output_top_logprobs,
            input_token_logprobs=msg.input_token_logprobs,
            input_top_logprobs=msg.input_top_logprobs,
            output_token_ids_logprobs=msg.output_token_ids_logprobs,
            input_token_ids_logprobs=msg.input_token_ids_logprobs,
            disagg_info=msg.disagg_info,
        )

    def handle_bytes(self, data: bytes) -> bytes:
        """One received message -> the bytes to push to the TokenizerManager."""
        try:
            msg = decode_msg(data)
        except Exception as e:  # msgspec raises DecodeError / ValidationError
            logger.warning("forwarding an undecodable message unchanged (%s: %s)", type(e).__name__, e)
            return data
        if isinstance(msg, BatchTokenIDOut):
            return encode_msg(self.handle_batch_token_id_out(msg))
        return data

    # ---------------------------------------------------------------- loop
    def parent_alive(self) -> bool:
        """False once the launcher's watch reports it gone (always True without a watch)."""
        return self.parent_watch is None or self.parent_watch.parent_alive()

    def stop(self) -> None:
        """Ask :meth:`event_loop` to return (thread-safe; takes effect within ``poll_interval_s``)."""
        self._stop_event.set()

    def event_loop(self) -> None:
        """Receive, detokenize, forward; until :meth:`stop` or the parent process dies."""
        poller = zmq.Poller()
        poller.register(self.recv_from_scheduler, zmq.POLLIN)
        timeout_ms = max(1, int(self.poll_interval_s * 1000))
        last_check = time.monotonic()
        while not self._stop_event.is_set():
            if poller.poll(timeout_ms):
                while True:
                    try:
                        data = self.recv_from_scheduler.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.send_to_tokenizer.send(self.handle_bytes(data))
            now = time.monotonic()
            if now - last_check >= self.poll_interval_s:
                last_check = now
                if not self.parent_alive():
                    logger.warning("parent process is gone; detokenizer exits")
                    return

    def close(self) -> None:
        """Close the sockets and the ZMQ context."""
        self.recv_from_scheduler.close(linger=0)
        self.send_to_tokenizer.close(linger=0)
        self._context.term()


def run_detokenizer_process(
    server_args: ServerArgs, port_args: PortArgs, parent_pid: Optional[int] = None,
    signal_parent_on_crash: bool = True, tokenizer_spec: Optional[BackendTokenizerSpec] = None,
    parent_watch: Any = None,
) -> None:
    """Entry point of the detokenizer child process (``multiprocessing`` spawn target).

    SIGTERM/SIGINT exit cleanly (status 0). If the loop crashes, the traceback is logged, the parent
    (``parent_pid``, default the spawning process) gets SIGTERM so no half-dead server remains, and the
    process exits with status 1. The loop also ends when ``parent_watch`` (a
    :class:`~sglang.srt.entrypoints.worker_launcher.ParentWatch`) reports the launcher gone.
    """
    configure_logger(server_args.log_level, "Detokenizer")
    if parent_pid is None:
        parent_pid = os.getppid()

    def _on_signal(signum: int, frame: Any) -> None:
        logger.info("received signal %d; exiting", signum)
        raise SystemExit(0)

    # While imports and the tokenizer load run (C/C++ code), a SystemExit raised by a signal handler surfaces as a
    # pybind11/ctypes error dump: during setup a stop request just ends the process quietly.
    main_thread = threading.current_thread() is threading.main_thread()  # a Ray actor runs us on one of its threads
    if main_thread:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        signal.signal(signal.SIGINT, lambda *_: os._exit(0))
    manager: Optional[DetokenizerManager] = None
    try:
        manager = DetokenizerManager(server_args, port_args, parent_watch=parent_watch, tokenizer_spec=tokenizer_spec)
        if main_thread:
            signal.signal(signal.SIGTERM, _on_signal)
            signal.signal(signal.SIGINT, _on_signal)
        manager.event_loop()
    except Exception:
        logger.error("DetokenizerManager crashed:\n%s", traceback.format_exc())
        if signal_parent_on_crash:  # off for the in-process Engine: the parent is the user's program
            try:
                os.kill(parent_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        raise SystemExit(1)
    finally:
        if manager is not None:
            manager.close()
