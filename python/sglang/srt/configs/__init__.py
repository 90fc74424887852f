"""sglang.srt.configs package."""
