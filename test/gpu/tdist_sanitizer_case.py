"""Small 2-rank Triton-distributed run for compute-sanitizer (memcheck / racecheck): message passing, AG-GEMM (SM
and CE producers), GEMM-RS and all-to-all once each on tiny shapes; with argument ``decomp`` only the decomposition
(DecompAgGemm / DecompGemmRs in 2 and 3 pieces, uneven rows, 3 back-to-back calls each: copy-engine pushes into the
peer's IPC-mapped heap, stream-op signals, cuBLAS, the fused addmm_ reduction); with ``a2a`` only the one-copy
all-to-all (dispatch, combine, a refused over-capacity count); with ``all`` the three in one group (decomp, a2a,
then the Triton kernels), each part's result printed as 'sanitizer part NAME rank R: ok' when it ends. Ranks are processes on
``cuda:(rank % device_count)`` (one per GPU when there are two). Prints 'sanitizer case: ok' or the problems, exits
non-zero on failure."""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(REPO / "sgl-kernel" / "python"), str(REPO / "python"), str(HERE)):
    sys.path.insert(0, p)
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "sgl-kernel" / "python"), str(REPO / "python"), str(HERE),
                                            os.environ.get("PYTHONPATH", "")])


def small(heap, note, nccl):
    import torch

    from sgl_kernel.tdist.ag_gemm import AgGemm
    from sgl_kernel.tdist.all_to_all import AllToAll
    from sgl_kernel.tdist.gemm_rs import GemmRs
    from sgl_kernel.tdist.reference import ag_gemm_ref, all_to_all_ref, gemm_rs_ref

    w, me, dev = heap.world, heap.rank, heap.device
    fails = []
    rows = [5, 11][:w]
    g = lambda s, *sh: torch.randn(*sh, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16).to(dev)  # noqa
    shards = [g(r, rows[r], 64) for r in range(w)]
    wt = g(99, 48, 64)
    for prod in ("sm", "ce"):
        out = AgGemm(heap, 32, 64, name=f"s.{prod}", producer=prod)(shards[me], wt.t(), rows)
        if (out.float() - ag_gemm_ref(shards, wt.t()).float()).abs().max() > 0.1:
            fails.append(f"ag_gemm {prod}")
    a = [g(10 + r, sum(rows), 40) for r in range(w)]
    b = [g(20 + r, 72, 40).t() for r in range(w)]
    out = GemmRs(heap, 16, 72)(a[me], b[me], rows)
    ref = gemm_rs_ref(a, b, rows)[me].float()
    # bf16 partials are rounded before the fp32 sum: allow a relative error (|values| reach ~30, 1 bf16 ulp = 0.125)
    if (out.float() - ref).abs().max() > 2e-2 * max(1.0, float(ref.abs().max())):
        fails.append("gemm_rs")
    sc = [[1, 3], [2, 0]]
    xs = [g(30 + r, sum(sc[r]), 32) for r in range(w)]
    o, rc = AllToAll(heap, 4, 32)(xs[me], torch.tensor(sc[me], dtype=torch.int32, device=dev))
    ref, rcr = all_to_all_ref(xs, sc)
    if rc.tolist() != rcr[me] or not torch.equal(o[: ref[me].shape[0]], ref[me]):
        fails.append("all_to_all")
    heap.barrier()
    return fails


def small_decomp(heap, note, nccl):
    """The decomposition ops on tiny uneven shapes vs the torch references; returns failures."""
    import torch

    from sgl_kernel.tdist.decomp import DecompAgGemm, DecompGemmRs
    from sgl_kernel.tdist.reference import ag_gemm_ref, gemm_rs_ref

    w, me, dev = heap.world, heap.rank, heap.device
    fails = []
    rows = [37, 20, 9, 50][:w]
    g = lambda s, *sh: torch.randn(*sh, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16).to(dev)  # noqa
    for c in (2, 3):
        ag = DecompAgGemm(heap, 128, 64, name=f"s.dag{c}", chunks=c)
        rs = DecompGemmRs(heap, 64, 72, name=f"s.drs{c}", chunks=c)
        for it in range(3):
            shards = [g(100 * c + 10 * it + r, rows[r], 64) for r in range(w)]
            wt = g(7 + it, 48, 64)
            out = ag(shards[me], wt.t(), rows)
            if (out.float() - ag_gemm_ref(shards, wt.t()).float()).abs().max() > 0.1:
                fails.append(f"decomp ag_gemm chunks={c} call {it}")
            a = [g(500 + 10 * it + r, sum(rows), 40) for r in range(w)]
            b = [g(600 + 10 * it + r, 72, 40).t() for r in range(w)]
            ref = gemm_rs_ref(a, b, rows)[me].float()
            out = rs(a[me], b[me], rows)
            if (out.float() - ref).abs().max() > 2e-2 * max(1.0, float(ref.abs().max())):
                fails.append(f"decomp gemm_rs chunks={c} call {it}")
    torch.cuda.synchronize(dev)
    heap.barrier()
    return fails


def small_a2a(heap, note, nccl, prefix=""):
    """The one-copy all-to-all alone (dispatch + combine, 3 calls with new counts, a refused over-capacity count in
    the last) vs the torch reference; returns failures. ``prefix``: of the ops' heap names (an all-to-all keeps its
    epochs per op object, so two ops must not share a name on one heap)."""
    import torch

    from sgl_kernel.tdist.all_to_all import AllToAll

    w, me, dev = heap.world, heap.rank, heap.device
    g = lambda s, *sh: torch.randn(*sh, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16).to(dev)  # noqa
    op = AllToAll(heap, 4, 32, name=f"{prefix}a2a", chunks=3)
    back = AllToAll(heap, 8, 32, name=f"{prefix}a2a.back", chunks=2)
    fails = []
    for it, sc in enumerate(([[1, 3], [2, 0]], [[4, 4], [0, 3]], [[2, 5], [1, 1]])):
        sc = [row[:w] for row in sc[:w]]
        xs = [g(30 + 10 * it + r, sum(sc[r]), 32) for r in range(w)]
        o, rc = op(xs[me], torch.tensor(sc[me], dtype=torch.int32, device=dev))
        pieces = [torch.split(x, row) for x, row in zip(xs, sc)]  # refused pieces (count > 4) are not delivered
        ref = torch.cat([pieces[s][me] for s in range(w) if sc[s][me] <= 4])
        want = [-1 if sc[s][me] > 4 else sc[s][me] for s in range(w)]
        if rc.tolist() != want or not torch.equal(o[: ref.shape[0]], ref):
            fails.append(f"all_to_all call {it}: counts {rc.tolist()} vs {want}")
        if it < 2:
            y, _ = back(o[: ref.shape[0]].contiguous(), rc)
            if not torch.equal(y[: xs[me].shape[0]], xs[me]):
                fails.append(f"all_to_all combine call {it}")
    torch.cuda.synchronize(dev)
    heap.barrier()
    return fails


def small_all(heap, note, nccl):
    """``decomp``, ``a2a`` and the Triton-kernel case (AG-GEMM SM / CE producers, GEMM-RS, all-to-all) in one group,
    so one compute-sanitizer start covers all three; each part's failures reach the parent as it ends
    (``note.result``), so a run cut by its time limit still shows the parts that finished."""
    fails = []
    parts = (("decomp", small_decomp), ("a2a", lambda *a: small_a2a(*a, prefix="p.")), ("kernels", small))
    for name, body in parts:
        note(f"part {name}")
        part = [f"{name}: {f}" for f in body(heap, note, nccl)]
        note.result(name, part)
        fails += part
    return fails


if __name__ == "__main__":
    from sgl_kernel.tdist.layout import HeapConfig
    from sgl_kernel.tdist.spawn import run_ranks

    from sglang.srt.utils.nvls_env import NVLS_OFF_ENV

    import tdist_sanitizer_case as me_mod

    mode = (sys.argv[1:] or [""])[0]
    body = {"decomp": me_mod.small_decomp, "a2a": me_mod.small_a2a, "all": me_mod.small_all}.get(mode, me_mod.small)
    res, problems = run_ranks(2, body, env=NVLS_OFF_ENV,
                              heap_config=HeapConfig(data_bytes=8 << 20, signal_slots=1024 if mode == "all" else 256),
                              timeout=600, on_result=lambda r, k, v: print(
                                  f"sanitizer part {k} rank {r}: {'ok' if not v else v}", flush=True))
    bad = problems + [f"rank {r}: {f}" for r, x in enumerate(res) if x for f in x]
    print("sanitizer case:", "ok" if not bad else bad)
    sys.exit(1 if bad else 0)
