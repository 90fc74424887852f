"""A small TokenWeave case for ``compute-sanitizer --tool racecheck --target-processes all``: 2 TP ranks as
processes on one GPU (``--tp-ranks-share-gpu`` mode), a random 2-layer Llama in bf16, tw-comm's fused
AllReduce-RMSNorm over CUDA IPC within the device, and one forward of a mixed batch cut into two token splits
on the two streams. Exits 0 when both ranks finish and their logits agree with each other (every rank samples
from the same all-gathered logits), non-zero otherwise; the sanitizer's report is what this case is for.

Usage (repo root): python test/gpu/tokenweave_racecheck_case.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "sgl-kernel" / "python"), str(REPO / "python"), str(REPO / "test" / "unit")]


def _rank(ps, path):
    import torch

    from tp_worker import STEPS, harness_for

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.tw_communicator import TwCommunicator
    from sglang.srt.model_loader.loader import load_model
    from sglang.srt.tokenweave import gemm_widths_of
    from sglang.srt.tokenweave.executor import TokenWeaveConfig, TokenWeaveExecutor

    class Cut(TokenWeaveExecutor):
        def plan(self, fb):
            return list(fb.split_tokens(fb.num_tokens // 2))

    dev = ps.torch_device()
    config = ModelConfig.from_path(path, None, "bfloat16", "cuda")
    comm = TwCommunicator(ps)
    model = load_model(config, "auto", str(dev), tp_rank=ps.tp_rank, tp_size=ps.tp_size, comm=comm)
    ex = Cut(TokenWeaveConfig(min_tokens=2, gemm_widths=gemm_widths_of(config, ps.tp_size)), dev)
    h = harness_for(model, config, ps.tp_size, device=str(dev))
    h.step(STEPS[0])
    out = h.run(h.prepare(STEPS[1]), ex).float().cpu()
    torch.cuda.synchronize()
    comm.ws.close()
    return out


def main() -> int:
    import torch
    import transformers

    from model_harness import randomize_weights
    from tp_worker import spawn_ranks

    from sglang.srt.utils.nvls_env import apply_nvls_off_env

    apply_nvls_off_env()
    d = tempfile.mkdtemp(prefix="tw-racecheck-")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    hf = transformers.LlamaForCausalLM(cfg).float()
    randomize_weights(hf, 5)
    hf.save_pretrained(d)
    a, b = spawn_ranks(_rank, 2, d, timeout=900, device="cuda", share_gpu=True)
    same = torch.equal(a, b)
    print(f"tokenweave racecheck case: 2 ranks finished, logits {a.shape}, ranks agree: {same}", flush=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
