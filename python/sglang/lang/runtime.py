"""``sgl.Runtime``: start an sglang server subprocess and use it as a frontend backend."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Any, Optional

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.srt.utils.nvls_env import NVLS_OFF_ENV

logger = logging.getLogger(__name__)

def _free_port(host: str) -> int:
    from sglang.srt.utils.common import free_tcp_ports

    return free_tcp_ports(1, host)[0]


def server_cli_args(server_args: dict[str, Any]) -> list[str]:
    """``{"tp_size": 2, "disable_radix_cache": True}`` -> ``["--tp-size", "2", "--disable-radix-cache"]``.

    True becomes a bare flag; None is omitted; False is omitted too, except for a field with a flag of its own for
    False (``ServerArgs``'s ``FALSE_FLAGS``, e.g. ``tokenweave_sharded_residual=False`` ->
    ``--tokenweave-full-residual``: omitting it would start the server with the default, True); lists/tuples give
    one value each.

    Raises:
        ValueError: a value is a dict or another non-scalar type.
    """
    from sglang.srt.server_args import FALSE_FLAGS

    out: list[str] = []
    for key, value in server_args.items():
        flag = "--" + key.replace("_", "-")
        if value is False and key in FALSE_FLAGS:
            out.append(FALSE_FLAGS[key])
            continue
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out.append(flag)
            out.extend(str(v) for v in value)
        elif isinstance(value, (str, int, float)):
            out += [flag, str(value)]
        else:
            raise ValueError(f"server argument {key}={value!r}: only strings, numbers, booleans and lists can "
                             "become command-line flags")
    return out


def _stop_process(proc: subprocess.Popen, timeout: float) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        logger.warning("server pid %d did not stop within %.0f s of SIGTERM; killing it", proc.pid, timeout)
        proc.kill()
        proc.wait(10)


class Runtime:
    """An sglang server (``python -m sglang.launch_server``) in a subprocess on a free port.

    Args:
        model_path: the model to serve (``--model-path``).
        host: interface to bind (default loopback).
        port: port to use (None: a free one).
        api_key: the server's ``--api-key`` (also used by :attr:`endpoint`).
        launch_timeout: seconds to wait for ``/health`` before giving up.
        log_level: the server's ``--log-level``.
        **server_args: any other server flag, by its ``ServerArgs`` name (``device="cpu"``,
            ``tp_size=2``, ``disable_radix_cache=True``, ...).

    Attributes:
        url: ``http://host:port``. endpoint: a :class:`RuntimeEndpoint` on it. pid: the server's pid.
        log_path: the file with the server's output (deleted by :meth:`shutdown`).

    Raises:
        RuntimeError: the server exited during startup or was not healthy within ``launch_timeout``
            (the message holds the tail of its log).
    """

    def __init__(self, model_path: Optional[str] = None, host: str = "127.0.0.1", port: Optional[int] = None,
                 api_key: Optional[str] = None, launch_timeout: float = 300.0, log_level: str = "error",
                 **server_args: Any) -> None:
        import requests

        self.port = port or _free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.api_key = api_key
        args = {"model_path": model_path, "host": host, "port": self.port, "api_key": api_key,
                "log_level": log_level, **server_args}
        cmd = [sys.executable, "-m", "sglang.launch_server", *server_cli_args(args)]
        fd, self.log_path = tempfile.mkstemp(prefix=f"sglang-runtime-{self.port}-", suffix=".log")
        self._log = os.fdopen(fd, "w")
        env = {**os.environ, **NVLS_OFF_ENV}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid
        self._finalizer = weakref.finalize(self, _stop_process, self.proc, 30.0)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        deadline = time.monotonic() + launch_timeout
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.shutdown()
                raise RuntimeError(f"the sglang server exited with code {self.proc.returncode} during startup:\n"
                                   f"{tail}")
            try:
                if requests.get(self.url + "/health", headers=headers, timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.shutdown()
                raise RuntimeError(f"the sglang server was not healthy within {launch_timeout} s:\n{tail}")
            time.sleep(0.5)
        self.endpoint = RuntimeEndpoint(self.url, api_key=api_key)

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the server's output."""
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "<no log>"

    def generate(self, prompt: Any, sampling_params: Optional[dict[str, Any]] = None, return_logprob: bool = False,
                 logprob_start_len: int = -1, top_logprobs_num: int = 0, **kwargs: Any) -> str:
        """A raw ``/generate`` call (``text`` = ``prompt``, a string or a list of strings); returns the
        response as a JSON string, as SGLang's ``Runtime.generate`` does (``json.loads`` it).
        Extra ``/generate`` fields (``rid``, ``return_text_in_logprobs``, ...) go in ``kwargs``.

        Raises:
            RuntimeError: the server answered with an error (its message included).
        """
        body = {"text": prompt, "sampling_params": sampling_params or {}, "return_logprob": return_logprob,
                "logprob_start_len": logprob_start_len, "top_logprobs_num": top_logprobs_num, **kwargs}
        return json.dumps(self.endpoint._request("POST", "/generate", body))

    async def async_generate(self, prompt: str, sampling_params: Optional[dict[str, Any]] = None):
        """Stream one generation: an async iterator of the new text pieces (``/generate`` SSE).

        Raises:
            RuntimeError: the server answered with an error.
        """
        import asyncio

        loop = asyncio.get_running_loop()
        body = {"text": prompt, "sampling_params": sampling_params or {}, "stream": True}
        resp = await loop.run_in_executor(None, lambda: self.endpoint._request("POST", "/generate", body, stream=True))
        lines = resp.iter_lines(decode_unicode=True)
        sent = 0
        try:
            while True:
                line = await loop.run_in_executor(None, next, lines, None)
                if line is None:
                    break
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                text = json.loads(data).get("text", "")
                if len(text) > sent:
                    yield text[sent:]
                    sent = len(text)
        finally:
            resp.close()

    def get_tokenizer(self):
        """The served model's tokenizer (transformers), loaded from the server's tokenizer path."""
        from transformers import AutoTokenizer

        info = self.endpoint.model_info
        return AutoTokenizer.from_pretrained(info.get("tokenizer_path") or info["model_path"])

    def encode(self, prompt: str) -> list[int]:
        """Token ids of ``prompt`` as the server tokenizes it (its tokenizer; special tokens added)."""
        if getattr(self, "_tokenizer", None) is None:
            self._tokenizer = self.get_tokenizer()
        return list(self._tokenizer.encode(prompt))

    def cache_prefix(self, prefix: str) -> None:
        """Prefill ``prefix`` once so later requests share its KV."""
        self.endpoint._request("POST", "/generate", {"text": prefix, "sampling_params": {"max_new_tokens": 0}})

    def flush_cache(self) -> Any:
        """Clear the server's prefix cache (``/flush_cache``); returns the endpoint's answer."""
        return self.endpoint.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        """The server's ``/get_server_info`` JSON."""
        return self.endpoint.get_server_info()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout`` s) and delete its log; idempotent."""
        _stop_process(self.proc, timeout)
        self._finalizer.detach()
        if not self._log.closed:
            self._log.close()
            try:
                os.remove(self.log_path)
            except OSError:
                pass

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
