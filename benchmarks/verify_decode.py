"""The short-query forward's suites alone (`validator.plan_decode`, `--suite full` cases) in each
dtype on the local GPU: what `dmattn-bench verify` runs for it beside a table's entries.

    python -m benchmarks verify-decode [--dtype bf16 --dtype fp16]

Prints one line per suite and dtype (stdout); exits 1 when a case fails.
"""

from __future__ import annotations

import argparse

import torch

from dmattn_bench.bench.operators import operator
from dmattn_bench.space import DTYPES, config_label
from dmattn_bench.tuning.plan_runner import run_plan
from dmattn_bench.tuning.validator import plan_decode


@operator("verify-decode", help="The short-query forward's full suites in each dtype on the local GPU")
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", action="append", choices=("bf16", "fp16"))
    args = parser.parse_args(argv)
    failed = False
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for dtype in args.dtype or ["bf16", "fp16"]:
        for label, result in run_plan(DTYPES[dtype], "cuda", plan_decode("cuda", "full")):
            worst = result.worst_ratios()
            ok = sum(c.status == "ok" for c in result.cases)
            print(f"{dtype} {label} {config_label(result.fwd_config)}: {ok}/{len(result.cases)} ok, status "
                  f"{result.status}, worst out {worst.get('out', 0):.3f} lse {worst.get('lse', 0):.3f}")
            for case in result.cases:
                if case.status != "ok":
                    failed = True
                    print(f"  {case.case}: {case.status} {case.reason}")
    return 1 if failed else 0
