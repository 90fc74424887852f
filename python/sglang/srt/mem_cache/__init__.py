"""sglang.srt.mem_cache package."""
