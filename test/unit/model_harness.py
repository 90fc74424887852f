"""The model tests' stand-in runtime; it lives in :mod:`sglang.test.model_harness` (benchmarks use it too)."""

from sglang.test.model_harness import ModelHarness, TinyKVPool, TinyReqToTokenPool, randomize_weights  # noqa: F401
