"""Benchmarks of sglang-tw, one subpackage per subject (``comm``, ``tokenweave``, ``tdist``, ``disaggregation``,
``afd``, ``decode``, ``serving``, ...), with the shared timing and record code in :mod:`benchmark.common`.

Run from the repository root: ``python -m benchmark.<subject>.<entry> --help``; ``python -m benchmark.report``
renders the current numbers per technique from the newest records under ``benchmark/results/``."""
