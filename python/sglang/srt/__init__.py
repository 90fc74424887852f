"""sglang.srt package."""
