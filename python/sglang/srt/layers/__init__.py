"""sglang.srt.layers package."""
