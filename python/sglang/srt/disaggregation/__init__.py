"""Prefill/decode disaggregation (KVDirect-style pull transfer; SGLang PD interface)."""
