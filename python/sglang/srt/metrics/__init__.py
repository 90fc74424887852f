"""sglang.srt.metrics package."""
