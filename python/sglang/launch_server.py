"""``python -m sglang.launch_server [--model-path PATH] ...``: start an HTTP server.

Without ``--model-path`` it serves the embedded default model ``sglang-tw/stories260K``
(a trained 260K-parameter TinyStories Llama shipped with the package).
"""

from __future__ import annotations

import logging
import sys

from sglang.srt.server_args import prepare_server_args
from sglang.srt.utils.common import configure_logger

logger = logging.getLogger("sglang.launch_server")


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and serve until SIGINT/SIGTERM. Returns the exit code (2: bad flags, 1: startup failed)."""
    try:
        args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        configure_logger("info", "Server")
        logger.error("%s", e)
        return 2
    configure_logger(args.log_level, "Server")
    from sglang.srt.entrypoints.launch import launch_server

    try:
        launch_server(args)
    except (RuntimeError, ValueError) as e:
        logger.error("%s", e)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
