"""Two-batch overlap (``--enable-two-batch-overlap``): every large enough batch runs as two micro-batches whose
layer stages interleave, so one micro-batch's communication (the expert-parallel dispatch / combine, or the
all-reduce of TP attention and of the all-reduce expert parallelism) hides under the other's compute.

DeepSeek-V3 technical report (2024), sec. 3.4; SGLang's two-batch overlap (LMSYS blog, 2025); vLLM's dual-batch
overlap. Parts: the split rules (:mod:`.split`), the auto-off table (:mod:`.auto_off`), the executor
(:mod:`.executor`) and the deployment surface (:mod:`.deploy`). See ``docs/expert_parallel.md``.
"""

from sglang.srt.two_batch_overlap.auto_off import AUTO_MIN_TOKENS, TBO_OFF, Threshold, auto_threshold, resolve_threshold
from sglang.srt.two_batch_overlap.split import (
    DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD,
    MicroBatchSplit,
    plan_micro_batches,
    split_decode,
    split_extend,
)

__all__ = ["AUTO_MIN_TOKENS", "DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD", "MicroBatchSplit", "TBO_OFF", "Threshold",
           "auto_threshold", "plan_micro_batches", "resolve_threshold", "split_decode", "split_extend"]
