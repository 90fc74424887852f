"""sglang.srt.distributed package."""
