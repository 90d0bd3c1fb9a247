"""Helpers for atom's tests, demo and benchmarks (tiny random checkpoints). Not imported by the
plugin path."""
