"""sglang.srt.entrypoints.openai package."""
