"""Benchmark metrics: success with intervals, pass@k, paired tests."""
