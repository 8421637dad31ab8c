#!/usr/bin/env bash
# Issue 56 on a lent H200: where packed documents lose speed (`python -m benchmarks varlen-probe
# --backward`), then the packed/window bench (`bench_groups.sh`: one run per workload group so a
# timeout keeps the groups before it, one report of them). Run from the repository root:
#   bash benchmarks/ship/h200_varlen_probe.sh OUT [probe] [bench]
# (BENCH_GROUPS="name:seconds ..." picks the groups and their time limits)
set -u
out=$1; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.txt" 2>&1
for step in "$@"; do
  if [ "$step" = probe ]; then
    start=$SECONDS
    timeout 150 python3 -m benchmarks varlen-probe --backward > "$out/probe.md" 2> "$out/probe.err"
    echo "probe rc $? in $((SECONDS - start)) s"
  else
    bash benchmarks/ship/bench_groups.sh "$out" configs/workloads/packed.yaml h200-packed \
      "${BENCH_GROUPS:-packed-causal:280 packed-bias-mask:280 window:200}"
  fi
done
