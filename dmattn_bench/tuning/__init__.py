"""Offline tuning: the search space pruning (`prune`), trials (`trials`), worker processes
(`workers`), the resumable journal (`journal`), kernel timing (`timing`, which the bench uses
too), the tuner (`tuner`), validation against the
contract (`validator`, `adversarial`), workloads (`workloads`), Ray cluster measuring (`cluster`),
the dispatch table writer (`table_writer`), learning the default configs from trial journals
(`learn_defaults`) and the CUDA kernels' compile check (`cuda_check`).

Never imported by the attention call path (`flash_dmattn_func`).
"""
