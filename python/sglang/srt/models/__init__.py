"""sglang.srt.models package."""
