"""sglang.srt.managers package."""
