"""Helpers shared by the tests and the benchmarks (library code: nothing here imports from ``test/``)."""
