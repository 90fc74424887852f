"""A tiny stand-in runtime for model tests and benchmarks: KV pool, req->token table, and ForwardBatch
construction (``benchmark/afd/bench.py`` times decode with it; the model tests compare against HF with it).

It mirrors what the ModelRunner does (scheduler-side ``ModelWorkerBatch`` ->
device ``ForwardBatch`` -> ``model.forward``) without the real pool/allocator
classes, so models can be checked against HF on CPU. KV slots are handed out
in a shuffled order so paging (non-contiguous slots) is exercised.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.forward_batch_info import ForwardBatch, ForwardMode, ModelWorkerBatch


class TinyKVPool:
    """Per-layer K and V buffers ``[num_slots, num_kv_heads, head_dim]``."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: str = "cpu"):
        self.k = [torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]

    def set_kv_buffer(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][loc] = k.to(self.k[layer].dtype)
        self.v[layer][loc] = v.to(self.v[layer].dtype)

    def k_scale(self, layer: int) -> float:
        """1.0: this pool stores unscaled values (the FP8 KV scales contract of ``MHATokenToKVPool``)."""
        return 1.0

    def v_scale(self, layer: int) -> float:
        """1.0 (see :meth:`k_scale`)."""
        return 1.0


class TinyReqToTokenPool:
    """``req_to_token`` int32 ``[num_reqs, max_len]``: the KV slot of each token of each request row."""

    def __init__(self, num_reqs: int, max_len: int, device: str = "cpu"):
        self.req_to_token = torch.zeros(num_reqs, max_len, dtype=torch.int32, device=device)


@dataclass
class _Req:
    row: int
    tokens: list[int] = field(default_factory=list)


class ModelHarness:
    """Runs a model over requests that grow step by step.

    ``step([(rid, new_token_ids), ...])`` appends the new tokens of each request
    (a new rid starts a request; an existing one extends its cached prefix, a
    single token being a decode step) and returns the next-token logits
    ``[bs, vocab]`` fp32 in the given order. The forward mode is DECODE when
    every request decodes, EXTEND when none does, MIXED otherwise.
    """

    def __init__(self, model, config, max_reqs: int = 8, max_len: int = 96, seed: int = 0, device: str = "cpu",
                 attention_backend: str = "torch_native", kv_cache_dtype=None, kv_scales=None):
        """``attention_backend``: ``torch_native`` (the per-request reference, over a :class:`TinyKVPool`) or
        ``triton`` (the server's GPU backend, over a real :class:`MHATokenToKVPool`; CUDA, or CPU under
        ``TRITON_INTERPRET=1``). ``kv_cache_dtype`` (a torch dtype, e.g. ``torch.float8_e4m3fn``) with optional
        ``kv_scales`` (:class:`~sglang.srt.mem_cache.kv_quant.KVScales`): a real :class:`MHATokenToKVPool` in that
        format for either backend (default: the model's dtype). Raises ValueError for another backend name."""
        self.model, self.device = model, device
        self.num_layers = config.num_hidden_layers
        slots = max_reqs * max_len
        if kv_cache_dtype is not None and attention_backend in ("torch_native", "triton"):
            from sglang.srt.layers.attention import create_attention_backend
            from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

            self.kv = MHATokenToKVPool(slots, 1, kv_cache_dtype, config.num_key_value_heads, config.head_dim,
                                       config.num_hidden_layers, device, scales=kv_scales)
            self.backend = create_attention_backend(attention_backend)
        elif attention_backend == "torch_native":
            self.kv = TinyKVPool(config.num_hidden_layers, slots + 1, config.num_key_value_heads,
                                 config.head_dim, config.dtype, device)
            self.backend = TorchNativeAttnBackend()
        elif attention_backend == "triton":
            from sglang.srt.layers.attention import create_attention_backend
            from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

            self.kv = MHATokenToKVPool(slots, 1, config.dtype, config.num_key_value_heads, config.head_dim,
                                       config.num_hidden_layers, device)  # slot 0 is the pool's reserved slot
            self.backend = create_attention_backend("triton")
        else:
            raise ValueError(f"attention_backend={attention_backend!r}: choose 'torch_native' or 'triton'")
        self.req_to_token_pool = TinyReqToTokenPool(max_reqs, max_len, device)
        gen = torch.Generator().manual_seed(seed)
        self.free_slots = (torch.randperm(max_reqs * max_len, generator=gen) + 1).tolist()  # slot 0 unused
        self.reqs: dict[object, _Req] = {}
        self.free_rows = list(range(max_reqs))[::-1]
        self.last_mode: ForwardMode | None = None

    def adopt_prefix(self, rid, donor, n: int) -> None:
        """Start request ``rid`` with the first ``n`` tokens (and KV slots) of ``donor``, as a radix-cache hit
        does: the next ``prepare`` extends ``rid`` after a cached prefix of ``n`` tokens."""
        src = self.reqs[donor]
        req = self.reqs[rid] = _Req(self.free_rows.pop(), list(src.tokens[:n]))
        r2t = self.req_to_token_pool.req_to_token
        r2t[req.row, :n] = r2t[src.row, :n]

    def tokens(self, rid) -> list[int]:
        return list(self.reqs[rid].tokens)

    def step(self, items: list[tuple[object, list[int]]], executor=None, poison: bool = True) -> torch.Tensor:
        """Append the items' tokens and run them (``executor``: a ModelExecutor, default the model's own
        forward); returns next-token logits ``[bs, vocab]``. ``poison``: see :meth:`run` (benchmarks pass False:
        the NaN fill is 2 writes per layer that a server step does not do)."""
        return self.run(self.prepare(items), executor, poison)

    def poison_kv(self, fb: ForwardBatch) -> None:
        """Fill the KV slots ``fb`` is about to write with NaN in every layer, so a stage that reads a slot before
        the batch (or, split, an earlier sub-batch) wrote it in the same layer shows up as NaN logits instead of
        silently reading the KV left there by an earlier run of the same batch."""
        loc = fb.out_cache_loc
        pool = fb.token_to_kv_pool  # the tiny pool or a real MHATokenToKVPool a test swapped in
        for layer in range(self.num_layers):
            for buf in (pool.get_key_buffer(layer), pool.get_value_buffer(layer)):
                if buf.element_size() == 1:  # FP8 (a view of byte storage): 0x7F is NaN in E4M3FN and E5M2
                    buf.view(torch.uint8)[loc] = 0x7F
                else:
                    buf[loc] = float("nan")

    def run(self, fb: ForwardBatch, executor=None, poison: bool = True) -> torch.Tensor:
        """Run a prepared batch (again: KV writes are idempotent) with ``executor`` or the plain forward.
        ``poison``: first NaN-fill the slots the batch writes (:meth:`poison_kv`)."""
        with torch.inference_mode():
            if poison:
                self.poison_kv(fb)
            if executor is not None:
                return executor.run(self.model, fb).next_token_logits
            self.backend.init_forward_metadata(fb)
            return self.model(fb.input_ids, fb.positions, fb).next_token_logits

    def prepare(self, items: list[tuple[object, list[int]]]) -> ForwardBatch:
        """Append the items' tokens (allocating KV slots) and build their ForwardBatch without running it."""
        ids, pos, locs, rows, prefix, ext, r2t_rows, r2t_cols = [], [], [], [], [], [], [], []
        for rid, new in items:
            if not new:
                raise ValueError(f"request {rid!r}: no new tokens")
            req = self.reqs.get(rid)
            if req is None:
                req = self.reqs[rid] = _Req(self.free_rows.pop())
            p = len(req.tokens)
            slots = [self.free_slots.pop() for _ in new]
            r2t_rows += [req.row] * len(new)
            r2t_cols += range(p, p + len(new))
            req.tokens.extend(new)
            ids += new
            pos += range(p, p + len(new))
            locs += slots
            rows.append(req.row)
            prefix.append(p)
            ext.append(len(new))
        r2t = self.req_to_token_pool.req_to_token  # one indexed write for the whole batch (not one per request)
        idx = torch.tensor([r2t_rows, r2t_cols, locs], dtype=torch.int64).to(r2t.device)
        r2t[idx[0], idx[1]] = idx[2].to(torch.int32)
        decodes = [e == 1 and p > 0 for p, e in zip(prefix, ext)]
        mode = ForwardMode.DECODE if all(decodes) else ForwardMode.MIXED if any(decodes) else ForwardMode.EXTEND
        self.last_mode = mode
        batch = ModelWorkerBatch(
            forward_mode=mode, input_ids=ids, positions=pos, out_cache_loc=torch.tensor(locs, dtype=torch.int64),
            req_pool_indices=rows, prefix_lens=prefix, extend_lens=ext,
            seq_lens=[p + e for p, e in zip(prefix, ext)], sample=[True] * len(items),
        )
        return ForwardBatch.init_new(batch, torch.device(self.device), self.req_to_token_pool, self.kv, self.backend)


def greedy_logits(h: "ModelHarness", executor=None, steps: int = 2, seed: int = 3) -> list:
    """Prefill 4 requests of 6 / 3 / 9 / 4 random token ids in [3, 512) (``seed``), then ``steps`` greedy decode
    steps through ``h`` (``executor``: e.g. an AFD executor; NaN poisoning off, as the benchmarks run); returns the
    logits of every step, each ``[4, vocab]`` on the harness's device."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (6, 3, 9, 4)]
    outs = [h.step([(i, p) for i, p in enumerate(prompts)], executor, poison=False)]
    for _ in range(steps):
        nxt = outs[-1].argmax(-1).tolist()
        outs.append(h.step([(i, [t]) for i, t in enumerate(nxt)], executor, poison=False))
    return outs


def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    """Re-draw a HF model's weights so activations and logits are O(1) (HF's init is too small for a
    meaningful 1e-4 check, and a wrong shard or kernel then shows up far above tolerance); norms near 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / (p.shape[-1] ** 0.5 if "embed" not in name else 1.0))
