"""Compatibility path (SGLang's module name): the batch types live in :mod:`sglang.srt.forward_batch_info`,
below ``layers/`` and ``model_executor/`` in the import graph so that both may import them."""

from sglang.srt.forward_batch_info import ForwardBatch, ForwardMode, ModelWorkerBatch

__all__ = ["ForwardBatch", "ForwardMode", "ModelWorkerBatch"]
