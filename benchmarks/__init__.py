"""Benchmark operators: scripts that produce evidence, each registered by name with the bench
harness (`dmattn_bench.bench.operators`). Not part of the installed package; run one from the
repository root with `python -m benchmarks NAME [ARGS...]` (`python -m benchmarks` lists them)."""
