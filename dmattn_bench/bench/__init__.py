"""Benchmarking: the bench harness (`harness`; its timing is the tuner's, `tuning.timing`), the
peer implementations registered as providers (`peers`) and the registry of benchmark operators
(`operators`).

Never imported by the attention call path (`flash_dmattn_func`).
"""
