"""The bootstrap server of a prefill server and its client (CONNECT, KVDirect sec. 4.1).

A prefill server's leader rank serves, on ``--disaggregation-bootstrap-port``, one small JSON document
``GET /route``: the control endpoint of its leader and, per TP rank, the transfer agent's name and
metadata (base64), the KV region descriptor (``KVRegionDescriptor.to_dict``) and the global KV heads it
holds. Decode ranks fetch it once per prefill server (lazily, on the first request naming it) and then
address every block by index x stride with no further round trip. ``GET /health`` answers 200.

The server is the standard library's threaded HTTP server on a daemon thread: no event loop is shared
with the scheduler, and nothing is pickled (JSON only).
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)


class BootstrapServer:
    """Serves ``route`` (a JSON-able dict) at ``http://host:port/route`` until :meth:`close`.

    Raises:
        OSError: the port is taken (the message names ``--disaggregation-bootstrap-port``).
    """

    def __init__(self, host: str, port: int, route: dict[str, Any]):
        body = json.dumps(route).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                if self.path == "/route":
                    self._reply(200, body)
                elif self.path == "/health":
                    self._reply(200, b"{}")
                else:
                    self._reply(404, json.dumps({"error": f"unknown path {self.path}; use /route"}).encode())

            def _reply(self, code: int, data: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        try:
            self.httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            raise OSError(f"cannot bind the bootstrap server to {host}:{port} ({e}); pass a free "
                          "--disaggregation-bootstrap-port") from e
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="disagg-bootstrap", daemon=True)
        self.thread.start()
        logger.info("bootstrap server on %s:%d", host, port)

    def close(self) -> None:
        """Stop serving and release the port."""
        self.httpd.shutdown()
        self.httpd.server_close()


def encode_metadata(data: bytes) -> str:
    """Agent metadata bytes -> a JSON string field."""
    return base64.b64encode(data).decode()


def decode_metadata(text: str) -> bytes:
    """Inverse of :func:`encode_metadata`."""
    return base64.b64decode(text)


def fetch_route(host: str, port: int, timeout_s: float) -> dict[str, Any]:
    """``GET http://host:port/route`` of a prefill server's bootstrap server.

    Raises:
        ConnectionError: unreachable, a non-200 answer or a malformed document (the message names the address).
    """
    import requests

    url = f"http://{host}:{port}/route"
    try:
        r = requests.get(url, timeout=timeout_s)
    except requests.RequestException as e:
        raise ConnectionError(f"bootstrap server {url} unreachable: {e}") from e
    if r.status_code != 200:
        raise ConnectionError(f"bootstrap server {url} answered {r.status_code}: {r.text[:200]}")
    try:
        route = r.json()
        _ = route["endpoint"], route["ranks"], route["tp_size"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConnectionError(f"bootstrap server {url} sent a malformed route: {e}") from e
    return route
