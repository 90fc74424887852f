"""Benchmarks of one subject; see README.md in this folder."""
