"""Benchmark scripts: each prints ratios against a peer measured in the same run."""
