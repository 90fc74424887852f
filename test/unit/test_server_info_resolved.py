"""``/get_server_info`` shows the settings as the scheduler resolved them at startup (``kv_cache_layout_resolved``,
``tokenweave_sharded_residual_resolved``) beside the raw server args, which keep SGLang's values ("auto", None)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.managers.scheduler_process import ready_info
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.model_executor.executors import SequentialExecutor
from sglang.srt.tokenweave.executor import TokenWeaveConfig, TokenWeaveExecutor


def _runner(layout, executor, kv=True):
    pool = MHATokenToKVPool(16, 1, torch.float32, 2, 4, 2, "cpu", layout) if kv else None
    return SimpleNamespace(max_total_tokens=16, max_running_requests=4, device=torch.device("cpu"),
                           token_to_kv_pool=pool, kv_cache=kv, executor=executor)


MC = SimpleNamespace(context_len=64, vocab_size=32, dtype=torch.float32, architecture="LlamaForCausalLM")


@pytest.mark.parametrize("layout", ["layer_major", "token_major"])
@pytest.mark.parametrize("sharded", [True, False])
def test_ready_info_reports_the_resolved_layout_and_residual_mode(layout, sharded):
    ex = TokenWeaveExecutor(TokenWeaveConfig(gemm_widths=(64, 32), sharded_residual=sharded), torch.device("cpu"))
    info = ready_info(_runner(layout, ex), MC, 0, 1)
    assert info["status"] == "ready" and info["kv_cache_layout_resolved"] == layout
    assert info["tokenweave_sharded_residual_resolved"] is sharded


def test_ready_info_without_tokenweave_or_kv_pool():
    info = ready_info(_runner("token_major", SequentialExecutor()), MC, 0, 1)
    assert info["kv_cache_layout_resolved"] == "token_major" and info["tokenweave_sharded_residual_resolved"] is False
    info = ready_info(_runner(None, SequentialExecutor(), kv=False), MC, 0, 1)  # an AFD FFN-only role: no KV pool
    assert info["kv_cache_layout_resolved"] is None
