"""sglang.srt.entrypoints package."""
