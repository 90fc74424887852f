"""sglang.srt.model_executor package."""
