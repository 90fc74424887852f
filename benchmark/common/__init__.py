"""The library every benchmark shares: timing (warm-ups, CUDA-event medians, A/B order alternation, a CPU timer
where there is no GPU) in :mod:`benchmark.common.timing`, and the JSON result record with its markdown rendering
and file naming in :mod:`benchmark.common.records`. Importing it imports no torch (torch is loaded when a CUDA
timer or the environment probe needs it)."""

from benchmark.common.records import (RESULTS_ROOT, SCHEMA_VERSION, SUBJECTS, add_ratio, environment, gpu_slug,
                                      load_record, make_record, record_stem, render_markdown, validate_record,
                                      write_record)
from benchmark.common.timing import (Timing, ab_order, compare, median, percentile, ratio, time_cpu,
                                     time_cuda_events, time_fn)

__all__ = [
    "RESULTS_ROOT", "SCHEMA_VERSION", "SUBJECTS", "add_ratio", "environment", "gpu_slug", "load_record", "make_record",
    "record_stem", "render_markdown", "validate_record", "write_record",
    "Timing", "ab_order", "compare", "median", "percentile", "ratio", "time_cpu", "time_cuda_events", "time_fn",
]
