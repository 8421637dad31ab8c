#!/usr/bin/env bash
# One `dmattn-bench bench` run per workload group of a workloads file, each under its own time
# limit so that a timeout keeps the groups before it, then one report of them all (markdown, JSON,
# PNG: bench_report.sh). Run from the repository root:
#   bash benchmarks/ship/bench_groups.sh OUT WORKLOADS.yaml REPORT "group:seconds ..." [bench options]
# e.g. the shape sweep of issue 58 on an H200, in two calls of the device tool:
#   bash benchmarks/ship/bench_groups.sh OUT configs/workloads/sweep.yaml h200-sweep "sweep-dims:300 sweep-fp16:200"
#   bash benchmarks/ship/bench_groups.sh OUT configs/workloads/sweep.yaml h200-sweep "sweep-kinds:300 sweep-lengths:250"
# A group whose JSON an earlier call left in OUT (bench-GROUP.json) joins the report without running
# again; delete it to time the group anew.
set -u
out=$1 workloads=$2 report=$3 groups=$4; shift 4
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.txt" 2>&1
for group in $groups; do
  name=${group%%:*}; limit=${group##*:}; start=$SECONDS
  [ -s "$out/bench-$name.json" ] && continue
  timeout "$limit" dmattn-bench bench --workloads "$workloads" --only "$name" --format json "$@" \
    > "$out/bench-$name.json" 2> "$out/bench-$name.txt"
  echo "bench $name rc $? in $((SECONDS - start)) s"
done
bash benchmarks/ship/bench_report.sh "$out" "$out/$report"
