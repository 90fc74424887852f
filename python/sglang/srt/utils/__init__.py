"""Small shared helpers: logging, ZMQ sockets, tokenizer loading, process cleanup."""

from sglang.srt.utils.common import (
    configure_logger,
    get_tokenizer,
    get_zmq_socket,
    kill_process_tree,
)

__all__ = ["configure_logger", "get_tokenizer", "get_zmq_socket", "kill_process_tree"]
