"""NIXL one-sided READ/WRITE of GPU memory (VRAM) between two processes on one GPU: a KV plan between two
real KV pools on ``cuda`` (page sizes 16 -> 4, TP 2 -> 1 heads) moves exactly the bytes direct indexing
says, and a write lands; run by scripts/gpu/kv_transfer.sh."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from sglang.srt.disaggregation.transfer import MemRegion, TransferConfig, TransferState, make_transfer_backend
from sglang.srt.disaggregation.transfer.base import nixl_available
from sglang.srt.disaggregation.transfer.kv_plan import coalesce_array, pick_sources, plan_kv_reads_array, with_tp
from sglang.srt.mem_cache.kv_cache import KVCache
from sglang.srt.mem_cache.kv_descriptor import KVRegionDescriptor

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not nixl_available()[0], reason=f"nixl: {nixl_available()[1]}")]
LAYERS, HEADS, DIM = 4, 4, 64


def _pool(page_size: int, pages: int, heads: int, seed: int):
    kv = KVCache.create(max_total_tokens=pages * page_size, page_size=page_size, dtype=torch.bfloat16,
                        head_num=heads, head_dim=DIM, layer_num=LAYERS, req_rows=1, max_context_len=8, device="cuda")
    t = kv.token_to_kv_pool.kv_data
    t.copy_(torch.randn(t.shape, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda"))
    return kv, t


def _prefill(conn, rank: int):
    torch.cuda.set_device(0)
    kv, t = _pool(16, 8, HEADS // 2, seed=rank)  # prefill TP rank `rank` of 2: half the heads
    agent = make_transfer_backend("nixl", f"prefill{rank}", TransferConfig(transfer_timeout_s=30))
    agent.register([MemRegion(t.data_ptr(), t.numel() * t.element_size(), "cuda:0")])
    conn.send((agent.local_metadata(), with_tp(kv.describe(), rank, 2, HEADS).to_dict(), t.cpu()))
    conn.recv()  # keep the memory alive until the decode side is done
    agent.close()


def test_vram_reads_hetero_tp_and_page_size():
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for r in range(2):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_prefill, args=(b, r), daemon=True)
        p.start()
        conns.append(a)
        procs.append(p)
    try:
        infos = [c.recv() for c in conns]
        kv, t = _pool(4, 40, HEADS, seed=9)  # decode TP 1, page size 4
        before = t.clone()
        me = make_transfer_backend("nixl", "decode0", TransferConfig(transfer_timeout_s=30))
        me.register([MemRegion(t.data_ptr(), t.numel() * t.element_size(), "cuda:0")])
        for r, (md, _, _) in enumerate(infos):
            me.connect(f"prefill{r}", md)
        remotes = [KVRegionDescriptor.from_dict(d) for _, d, _ in infos]
        local = with_tp(kv.describe(), 0, 1, HEADS)
        n_tok, src_pages, dst_pages = 45, [5, 2, 7], [30, 31, 3, 9, 10, 11, 20, 21, 22, 1, 2, 33]
        for rank, heads in pick_sources(remotes, local):
            ops = coalesce_array(plan_kv_reads_array(remotes[rank], local, src_pages, dst_pages, n_tok, heads=heads))
            h = me.read(f"prefill{rank}", ops)
            assert me.wait(h, 60) is TransferState.DONE, h.error
        torch.cuda.synchronize()
        full = torch.cat([infos[0][2], infos[1][2]], dim=3)  # [L, 2, slots, HEADS, DIM] on the host
        rs = [src_pages[i // 16] * 16 + i % 16 for i in range(n_tok)]
        ls = [dst_pages[i // 4] * 4 + i % 4 for i in range(n_tok)]
        want = before.cpu()
        want[:, :, ls] = full[:, :, rs]
        assert torch.equal(t.cpu(), want)
        # write: push one page of layer 0 K back into prefill1's page 1 region and read it again
        ops = plan_kv_reads_array(remotes[1], local, [1], [30, 31, 3, 9], 16, heads=(2, 4))
        h = me.write("prefill1", coalesce_array(ops))
        assert me.wait(h, 60) is TransferState.DONE, h.error
        scratch = torch.zeros_like(t)
        me.register([MemRegion(scratch.data_ptr(), scratch.numel() * scratch.element_size(), "cuda:0")])
        ops2 = ops.copy()
        ops2[:, 1] += scratch.data_ptr() - t.data_ptr()
        h = me.read("prefill1", ops2)
        assert me.wait(h, 60) is TransferState.DONE, h.error
        lsl = [[30, 31, 3, 9][i // 4] * 4 + i % 4 for i in range(16)]
        assert torch.equal(scratch[:, :, lsl, 2:4], t[:, :, lsl, 2:4])
        me.close()
    finally:
        for c in conns:
            try:
                c.send(True)
            except OSError:
                pass
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
