"""Triton attention kernels over the paged KV pool: split-KV decode and prefix-aware extend."""

from sglang.srt.layers.attention.triton_ops.decode_attention import (decode_attention_fwd,
                                                                      decode_attention_workspace,
                                                                      default_num_kv_splits)
from sglang.srt.layers.attention.triton_ops.extend_attention import extend_attention_fwd

__all__ = ["decode_attention_fwd", "decode_attention_workspace", "default_num_kv_splits", "extend_attention_fwd"]
