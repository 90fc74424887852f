"""``sgl.Engine``: the server's processes in-process, without HTTP.

The scheduler and detokenizer run as subprocesses exactly as under ``launch_server``
(:func:`~sglang.srt.entrypoints.launch.launch_subprocesses`); the
:class:`~sglang.srt.managers.tokenizer_manager.TokenizerManager` runs on a private asyncio
event loop in a daemon thread of the calling process. Synchronous methods submit coroutines
to that loop and wait; ``async_generate`` bridges the caller's event loop to it, so an
Engine can be used from plain scripts, threads and asyncio code alike.

Outputs are SGLang's ``/generate`` dicts (``{"text", "output_ids", "meta_info"}``): one dict
for one prompt, a list for a batch; streaming yields cumulative dicts (batch chunks carry
``"index"``).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures as cf
import dataclasses
import logging
import shutil
import threading
from typing import Any, AsyncIterator, Iterator, Optional, Union

logger = logging.getLogger(__name__)

Prompt = Union[str, list[str], None]
SamplingParamsArg = Union[dict[str, Any], list[dict[str, Any]], None]


MAIN_GUARD_HINT = ("sgl.Engine was created while a subprocess was importing your script: the engine's subprocesses "
                   "are spawned and re-import the main module, so create the Engine under "
                   "`if __name__ == \"__main__\":`")



def _no_images(image_data: Any) -> None:
    if image_data is not None:
        raise ValueError("image_data: this server runs text-only models; send text or input_ids")

class Engine:
    """An in-process inference engine (SGLang's ``sgl.Engine``).

    Args:
        model_path: HF checkpoint folder (or an embedded model's name, e.g. ``sglang-tw/stories260K``). May also be
            passed as a keyword in ``server_args_kwargs``.
        **server_args_kwargs: any :class:`~sglang.srt.server_args.ServerArgs` field by its Python
            name (``device="cpu"``, ``max_total_tokens=4096``, ``grammar_backend="none"``, ...);
            HTTP fields (host, port, api_key) are ignored.
    Raises:
        ValueError: an unknown keyword (named) or an invalid setting.
        RuntimeError: the scheduler failed to start (its message says why).

    Example::

        with Engine(model_path="path/to/model", device="cpu") as engine:
            out = engine.generate("Once upon a time", {"max_new_tokens": 16, "temperature": 0})
            print(out["text"])
    """

    def __init__(self, model_path: Optional[str] = None, **server_args_kwargs: Any) -> None:
        import multiprocessing as mp

        from sglang.srt.deployment.compose import plan_deployment
        from sglang.srt.entrypoints.launch import launch_subprocesses, resolve_model
        from sglang.srt.server_args import PortArgs, ServerArgs

        if getattr(mp.current_process(), "_inheriting", False):
            raise RuntimeError(MAIN_GUARD_HINT)
        if model_path is not None:
            server_args_kwargs["model_path"] = model_path
        known = {f.name for f in dataclasses.fields(ServerArgs)}
        unknown = sorted(set(server_args_kwargs) - known)
        if unknown:
            raise ValueError(f"unknown Engine argument(s) {', '.join(unknown)}; use ServerArgs field names "
                             f"(e.g. device, max_total_tokens, tp_size)")
        self._closed = False
        self._lock = threading.Lock()
        self.server_args = resolve_model(ServerArgs(**server_args_kwargs))
        plan = plan_deployment(self.server_args)  # every technique validated before anything starts
        self.port_args = PortArgs.init_new(plan.zmq_transport)
        self._procs = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self.tokenizer_manager = None
        try:
            self._procs = launch_subprocesses(self.server_args, self.port_args, in_process_engine=True, plan=plan)
            self.port_args = self._procs.port_args or self.port_args  # scheduler groups, or --use-ray's endpoints
            self._procs.watch(self._on_child_death)
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._run_loop, name="sglang-engine-loop", daemon=True)
            self._thread.start()
            self.tokenizer_manager = self._run(self._make_tokenizer_manager())
        except BaseException:
            self.shutdown()
            raise
        atexit.register(self.shutdown)
        logger.info("engine ready: %s", self.server_args.model_name)

    # ------------------------------------------------------------ plumbing
    def _on_child_death(self) -> None:
        """Watchdog callback: a subprocess died; fail in-flight and later requests with its cause."""
        logger.error("an engine subprocess died: %s; shut the Engine down", self._procs.failure)
        if self.tokenizer_manager is not None:
            self.tokenizer_manager.fail_all_threadsafe(f"an engine subprocess died: {self._procs.failure}")

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _make_tokenizer_manager(self):
        from sglang.srt.managers.tokenizer_manager import TokenizerManager

        tm = TokenizerManager(self.server_args, self._procs.port_args or self.port_args, self._procs.scheduler_info,
                              inbox=self._procs.take_tokenizer_inbox(), tokenizer=self._procs.tokenizer)
        tm.start()
        return tm

    def _submit(self, coro) -> cf.Future:
        if self._closed:
            coro.close()
            raise RuntimeError("the Engine is shut down; create a new one")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro) -> Any:
        """Run ``coro`` on the engine loop and wait for its result (from any thread but the loop's)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("Engine methods must not be called from the engine's own event loop thread")
        return self._submit(coro).result()

    def _make_request(self, prompt: Prompt, sampling_params: SamplingParamsArg, input_ids, return_logprob,
                      logprob_start_len, top_logprobs_num, stream: bool, rid):
        from sglang.srt.managers.generate_req import GenerateReqInput

        body: dict[str, Any] = {"stream": bool(stream)}
        for name, value in (("text", prompt), ("input_ids", input_ids), ("sampling_params", sampling_params),
                            ("return_logprob", return_logprob), ("logprob_start_len", logprob_start_len),
                            ("top_logprobs_num", top_logprobs_num), ("rid", rid)):
            if value is not None:
                body[name] = value
        return GenerateReqInput.from_dict(body)

    async def _collect(self, obj) -> Any:
        out = None
        async for item in self.tokenizer_manager.generate_request(obj):
            out = item
        return out

    # ------------------------------------------------------------ generation
    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: SamplingParamsArg = None,
        input_ids: Optional[Union[list[int], list[list[int]]]] = None,
        image_data: Any = None,
        *,
        return_logprob: Optional[Union[bool, list[bool]]] = None,
        logprob_start_len: Optional[Union[int, list[int]]] = None,
        top_logprobs_num: Optional[Union[int, list[int]]] = None,
        stream: bool = False,
        rid: Optional[Union[str, list[str]]] = None,
    ) -> Union[dict[str, Any], list[dict[str, Any]], Iterator[dict[str, Any]]]:
        """Generate synchronously (blocks the calling thread; safe from several threads at once).

        Args:
            prompt: a string or a list of strings (a batch); or use ``input_ids``.
            sampling_params: one dict for all prompts or a list (SGLang's keys: max_new_tokens,
                temperature, top_p, top_k, stop, regex, json_schema, ebnf, n, seed, ...).
            input_ids: token ids of one prompt (list[int]) or a batch (list[list[int]]).
            image_data: SGLang's multimodal input, in SGLang's position; this fork serves text
                models only, so anything but None is a ValueError. Later arguments are keyword-only.
            return_logprob / logprob_start_len / top_logprobs_num: as in ``/generate``.
            stream: return an iterator of cumulative output dicts instead of the final output.
            rid: request id(s) (generated when absent).
        Returns:
            One dict (single prompt), a list of dicts (batch or ``n`` > 1), or with ``stream`` a
            sync iterator of dicts (batch chunks carry ``"index"``). Breaking out of the iterator
            aborts the unfinished requests.
        Raises:
            ValueError: invalid input (names the field), e.g. an invalid regex or schema.
            RequestError: the scheduler rejected or aborted the request (``status_code``, ``message``).
            RuntimeError: the engine is shut down.
        """
        _no_images(image_data)
        obj = self._make_request(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                 top_logprobs_num, stream, rid)
        if not stream:
            return self._run(self._collect(obj))
        return self._sync_stream(obj)

    def _sync_stream(self, obj) -> Iterator[dict[str, Any]]:
        agen = self.tokenizer_manager.generate_request(obj)
        try:
            while True:
                try:
                    item = self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
                yield item
        finally:
            if not self._closed:
                try:
                    self._run(agen.aclose())
                except Exception:  # noqa: BLE001 - best effort abort of unfinished requests
                    logger.debug("closing a stream failed", exc_info=True)

    async def async_generate(
        self,
        prompt: Prompt = None,
        sampling_params: SamplingParamsArg = None,
        input_ids: Optional[Union[list[int], list[list[int]]]] = None,
        image_data: Any = None,
        *,
        return_logprob: Optional[Union[bool, list[bool]]] = None,
        logprob_start_len: Optional[Union[int, list[int]]] = None,
        top_logprobs_num: Optional[Union[int, list[int]]] = None,
        stream: bool = False,
        rid: Optional[Union[str, list[str]]] = None,
    ) -> Union[dict[str, Any], list[dict[str, Any]], AsyncIterator[dict[str, Any]]]:
        """Like :meth:`generate`, awaitable from any event loop.

        Returns:
            The output dict / list; with ``stream`` an async iterator of cumulative dicts
            (``async for chunk in await engine.async_generate(..., stream=True)``). Cancelling
            the awaiting task aborts the request.
        Raises:
            ValueError / RequestError / RuntimeError: as :meth:`generate`.
        """
        _no_images(image_data)
        obj = self._make_request(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                 top_logprobs_num, stream, rid)
        if not stream:
            return await asyncio.wrap_future(self._submit(self._collect(obj)))
        return self._async_stream(obj)

    async def _async_stream(self, obj) -> AsyncIterator[dict[str, Any]]:
        agen = self.tokenizer_manager.generate_request(obj)
        try:
            while True:
                try:
                    item = await asyncio.wrap_future(self._submit(agen.__anext__()))
                except StopAsyncIteration:
                    return
                yield item
        finally:
            if not self._closed:
                try:
                    await asyncio.wrap_future(self._submit(agen.aclose()))
                except Exception:  # noqa: BLE001 - best effort abort of unfinished requests
                    logger.debug("closing a stream failed", exc_info=True)

    def score(self, query: Optional[Union[str, list[int]]] = None,
              items: Optional[Union[str, list[str], list[list[int]]]] = None,
              label_token_ids: Optional[list[int]] = None, apply_softmax: bool = False,
              item_first: bool = False) -> list[list[float]]:
        """SGLang's ``Engine.score``: per item, the probabilities of ``label_token_ids`` as the next token after
        ``query + item`` (``item + query`` with ``item_first``); see
        :mod:`~sglang.srt.entrypoints.openai.serving_score` (``/v1/score``).

        Returns:
            ``[[float per label] per item]``.
        Raises:
            ValueError: bad input (e.g. ``Token ID 999999 is out of vocabulary (vocab size: V)``).
        """
        from sglang.srt.entrypoints.openai.serving_score import ScoringRequest, score_request

        req = ScoringRequest(query=query, items=items, label_token_ids=label_token_ids,
                             apply_softmax=apply_softmax, item_first=item_first)
        return self._run(score_request(self.tokenizer_manager, req))["scores"]

    # ------------------------------------------------------------ control
    def flush_cache(self):
        """Drop the prefix cache (refused while requests run).

        Returns:
            :class:`~sglang.srt.managers.io_struct.FlushCacheReqOutput` (``success``, ``message``).
        """
        return self._run(self.tokenizer_manager.flush_cache())

    def get_server_info(self) -> dict[str, Any]:
        """Server settings, what the scheduler reported at startup, and its live state
        (``internal_states``: KV usage, queue lengths; one per data-parallel scheduler), as ``/get_server_info``
        returns."""
        import sglang

        states = self._run(self.tokenizer_manager.get_internal_states())
        args = dataclasses.asdict(self.server_args)
        if args.get("api_key"):
            args["api_key"] = "<redacted>"
        return {**args, **self.tokenizer_manager.scheduler_info, "internal_states": states,
                "version": getattr(sglang, "__version__", "unknown")}

    def shutdown(self) -> None:
        """Abort in-flight requests, stop the loop thread and the subprocesses (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.shutdown)
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            if self.tokenizer_manager is not None:
                async def close_tm() -> None:
                    """Close the tokenizer manager on its own event loop."""
                    self.tokenizer_manager.close()

                try:
                    asyncio.run_coroutine_threadsafe(close_tm(), loop).result(timeout=10)
                except Exception:  # noqa: BLE001 - keep shutting down
                    logger.warning("closing the tokenizer manager failed", exc_info=True)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
        if loop is not None and not loop.is_running():
            loop.close()
        if self._procs is not None:
            self._procs.shutdown()
        shutil.rmtree(self.port_args.ipc_dir, ignore_errors=True)
        logger.info("engine shut down")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:  # best effort; atexit covers interpreter exit
        try:
            if not getattr(self, "_closed", True):
                self.shutdown()
        except Exception:  # noqa: BLE001
            pass
