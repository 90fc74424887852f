"""Reference attention over the paged KV pool in plain PyTorch (CPU and GPU).

It gathers each request's keys/values through ``req_to_token`` and runs
``scaled_dot_product_attention`` per request, so it is the correctness
reference for every faster backend. FP8 pools (``--kv-cache-dtype fp8_*``) are
emulated exactly as the Triton path stores them: the pool quantizes on write, and
the gathered FP8 values are dequantized with the layer's scales
(:func:`~sglang.srt.mem_cache.kv_quant.dequantize_kv`) before the attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.kv_quant import dequantize_kv


class TorchNativeAttnBackend(AttentionBackend):
    """Per-request SDPA over gathered KV (see :class:`AttentionBackend` for the contract)."""

    def forward(self, q, k, v, layer, forward_batch):
        """Write k/v ``[N, num_kv_heads*head_dim]`` of the new tokens at ``out_cache_loc``, then per request run causal
        SDPA of q ``[N, num_heads*head_dim]`` over its cached + new keys (GQA by repeating kv heads). Returns ``[N,
        num_heads*head_dim]`` in q's dtype."""
        nh, nkv, hd = layer.num_heads, layer.num_kv_heads, layer.head_dim
        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k.view(-1, nkv, hd), v.view(-1, nkv, hd))
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        ks, vs = pool.k_scale(layer.layer_id), pool.v_scale(layer.layer_id)
        q = q.view(-1, nh, hd)
        out = torch.empty_like(q)
        group = nh // nkv
        start = 0
        for i in range(forward_batch.batch_size):
            ext = forward_batch.extend_lens_cpu[i]
            seq = forward_batch.seq_lens_cpu[i]
            prefix = seq - ext
            slots = req_to_token[forward_batch.req_pool_indices[i], :seq].long()
            ki = dequantize_kv(k_buf[slots], ks, q.dtype)  # [seq, nkv, hd]
            vi = dequantize_kv(v_buf[slots], vs, q.dtype)
            qi = q[start:start + ext].transpose(0, 1)  # [nh, ext, hd]
            ki = ki.transpose(0, 1).repeat_interleave(group, dim=0)  # [nh, seq, hd]
            vi = vi.transpose(0, 1).repeat_interleave(group, dim=0)
            mask = None
            if ext > 1:
                # query j (absolute position prefix + j) sees keys 0 .. prefix + j
                qpos = torch.arange(prefix, seq, device=q.device).unsqueeze(1)
                kpos = torch.arange(seq, device=q.device).unsqueeze(0)
                mask = kpos <= qpos
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=layer.scaling)
            out[start:start + ext] = oi.transpose(0, 1)
            start += ext
        return out.view(-1, nh * hd)
