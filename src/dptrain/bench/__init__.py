"""Benchmarks: variants measured side by side in one run (not tests)."""
