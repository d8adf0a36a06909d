"""Benchmarks. Each reports ratios measured side by side in one run against a named baseline."""
