"""The extend/prefill attention kernel (unmasked off-diagonal tiles, masked diagonal tiles, exp2 softmax)
vs a torch reference on fresh random inputs, at every tile config it may run with.

Cases: cached prefixes not aligned to any tile, decode rows (extend 1) mixed with long extends, GQA, head_dim a power
of two and not (masked head dim), paged KV with page sizes 1 and 16 (shuffled pages), BLOCK_N larger and smaller
than BLOCK_M. On a CPU host the kernel runs in the Triton interpreter with small tiles; on a CUDA host (the GPU
round) the compiled kernel runs at the per-arch default and the Hopper/Ampere tile configs in bf16.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set; import triton lazily in that module",
                    pytrace=False)
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from sgl_kernel.triton.extend_attention import extend_attention_fwd, extend_config  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")


def reference(q, kb, vb, r2t, rows, prefix, ext, start, scale, nkv):
    """fp32 torch attention: request i's queries (absolute positions prefix..) see keys 0..position (causal)."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    group = q.shape[1] // nkv
    for i in range(len(prefix)):
        p, e, s = prefix[i], ext[i], start[i]
        slots = r2t[rows[i], : p + e].long()
        k = kb[slots].float().repeat_interleave(group, 1)  # [p+e, nh, hd]
        v = vb[slots].float().repeat_interleave(group, 1)
        qi = q[s: s + e].float()
        sc = torch.einsum("qhd,khd->hqk", qi, k) * scale
        allowed = torch.arange(p + e)[None, :] <= (p + torch.arange(e))[:, None]
        sc = sc.masked_fill(~allowed, float("-inf"))
        out[s: s + e] = torch.einsum("hqk,khd->qhd", sc.softmax(-1), v)
    return out


def run_case(gen, prefix, ext, nh, nkv, hd, page, dtype, config):
    bs = len(prefix)
    seq = [p + e for p, e in zip(prefix, ext)]
    pages_per = [-(-s // page) for s in seq]
    total_pages = sum(pages_per) + 3
    perm = torch.randperm(total_pages, generator=gen)
    max_ctx = max(pages_per) * page
    r2t = torch.zeros(bs + 2, max_ctx, dtype=torch.int32)
    rows = (torch.randperm(bs + 2, generator=gen)[:bs]).tolist()
    used = 0
    for i in range(bs):
        pg = perm[used: used + pages_per[i]]
        used += pages_per[i]
        sl = (pg[:, None] * page + torch.arange(page)[None, :]).reshape(-1)
        r2t[rows[i], : sl.numel()] = sl.int()
    n = sum(ext)
    q = torch.randn(n, nh, hd, generator=gen).to(dtype)
    kb = torch.randn(total_pages * page, nkv, hd, generator=gen).to(dtype)
    vb = torch.randn(total_pages * page, nkv, hd, generator=gen).to(dtype)
    start = [sum(ext[:i]) for i in range(bs)]
    scale = hd ** -0.5
    ref = reference(q, kb, vb, r2t, rows, prefix, ext, start, scale, nkv)
    i64 = dict(dtype=torch.int64, device=DEV)
    out = torch.full((n, nh, hd), float("nan"), dtype=dtype, device=DEV)
    extend_attention_fwd(q.to(DEV), out, kb.to(DEV), vb.to(DEV), r2t.to(DEV), torch.tensor(rows, **i64),
                         torch.tensor(prefix, **i64), torch.tensor(ext, **i64), torch.tensor(start, **i64), max(ext),
                         scale, config=config)
    return out.float().cpu(), ref


TOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}

if CUDA:
    CONFIGS = [None, (128, 64, 8, 2), (64, 128, 8, 2)]  # None: extend_config for this GPU, (128, 128, 8, 3) on H100
    SHAPES = [([0, 300, 1000, 77], [1000, 129, 1, 513], 32, 8, 128), ([5, 0], [300, 64], 8, 8, 80),
              ([7, 100, 0], [5, 1, 3], 32, 8, 128)]  # short extends: BLOCK_M clamps to 16
    DTYPES = [torch.bfloat16]
else:
    CONFIGS = [None, (32, 32, 4, 1), (16, 32, 4, 1), (32, 16, 4, 1)]
    SHAPES = [([0, 37, 5, 64], [45, 20, 1, 33], 4, 2, 64), ([3, 0], [40, 17], 2, 1, 24)]
    DTYPES = [torch.float32]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"hd{s[4]}-ext{max(s[1])}")
@pytest.mark.parametrize("page", [1, 16])
def test_extend_kernel_matches_reference(config, shape, page):
    prefix, ext, nh, nkv, hd = shape
    for dtype in DTYPES:
        gen = torch.Generator().manual_seed(1000 * page + hd + sum(prefix))
        out, ref = run_case(gen, prefix, ext, nh, nkv, hd, page, dtype, config)
        assert not torch.isnan(out).any(), "rows left unwritten or NaN"
        err = (out - ref).abs().max().item()
        assert err <= TOL[dtype] * max(1.0, ref.abs().max().item()), (config, page, hd, err)


def test_extend_config_per_arch_and_bad_config():
    assert extend_config(128, None) == (32, 32, 4, 1)
    assert extend_config(128, (9, 0)) == (128, 128, 8, 3)
    assert extend_config(128, (8, 0)) == (128, 64, 8, 2)
    q = torch.zeros(4, 2, 16, device=DEV)
    kb = torch.zeros(8, 2, 16, device=DEV)
    i64 = dict(dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="powers of two"):
        extend_attention_fwd(q, q.clone(), kb, kb.clone(), torch.zeros(1, 8, dtype=torch.int32, device=DEV),
                             torch.zeros(1, **i64), torch.zeros(1, **i64), torch.full((1,), 4, **i64),
                             torch.zeros(1, **i64), 4, 0.25, config=(48, 32, 4, 1))
