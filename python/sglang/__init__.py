"""sglang-tw: an SGLang-compatible serving engine (this fork's ``sglang`` package).

The server lives in :mod:`sglang.srt`; start it with ``python -m sglang.launch_server``.
"""

__version__ = "0.1.0"
