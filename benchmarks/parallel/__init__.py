"""Distributed benchmarks: expert parallelism, collective bytes, async save, faults, meta init, memory."""
