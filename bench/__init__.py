"""Benchmarks: scripts that print a table and the ratio against a peer run."""
