"""Offline tuning: the search space pruning (`prune`), trials (`trials`), worker processes
(`workers`), the resumable journal (`journal`), the tuner (`tuner`), validation against the
contract (`validator`, `adversarial`), workloads (`workloads`), Ray cluster measuring (`cluster`)
and the dispatch table writer (`table_writer`).

Never imported by the attention call path (`flash_dmattn_func`).
"""
