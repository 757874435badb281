"""Causal LMs: loading, saving, building, and which dtype a CPU computes in."""
