"""sglang.srt.model_loader package."""
