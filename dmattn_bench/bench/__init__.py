"""Benchmarking: the bench harness (`harness`), GPU timing (`timing`), the peer
implementations registered as providers (`peers`) and the registry of benchmark operators
(`operators`).

Never imported by the attention call path (`flash_dmattn_func`).
"""
