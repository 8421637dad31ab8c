"""Operators of the CUDA backend: its checks, probes and sweeps (`python -m benchmarks cuda-...`)."""
