"""sglang.srt.sampling package."""
