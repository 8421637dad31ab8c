#!/usr/bin/env bash
# Issue 56 on a lent H200: where packed documents lose speed (`python -m benchmarks varlen-probe
# --backward`), then the packed/window bench, one run per workload group so a timeout keeps the
# groups before it; `dmattn-bench bench --from-json A --from-json B ...` renders them as one report. Run from the
# repository root: bash benchmarks/ship/h200_varlen_probe.sh OUT [probe] [bench] (BENCH_GROUPS="name:seconds ..."
# picks the groups and their time limits)
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
    reports=()
    for group in ${BENCH_GROUPS:-packed-causal:280 packed-bias-mask:280 window:200}; do
      name=${group%%:*}; limit=${group##*:}; start=$SECONDS
      timeout "$limit" dmattn-bench bench --workloads configs/workloads/packed.yaml --only "$name" --format json \
        > "$out/bench-$name.json" 2> "$out/bench-$name.txt"
      echo "bench $name rc $? in $((SECONDS - start)) s"
      [ -s "$out/bench-$name.json" ] && reports+=(--from-json "$out/bench-$name.json")
    done
    dmattn-bench bench "${reports[@]}" --format json > "$out/h200-packed.json"
    dmattn-bench bench "${reports[@]}" --format markdown > "$out/h200-packed.md"
    dmattn-bench bench "${reports[@]}" --plot "$out/h200-packed.png" > /dev/null
    cat "$out/h200-packed.md"
  fi
done
