#!/usr/bin/env bash
# Issue 55 on a lent H200: host code moved, nothing a kernel compiles changed. Checks, this tree
# against an earlier one where a figure is compared:
#   mkdir before && git archive BEFORE_COMMIT benchmarks dmattn_bench kernels results/tables configs | tar x -C before
#   bash benchmarks/ship/h200_house_check.sh OUT before tier    # the GPU tier, `verify --suite full` of the
#                                                               # shipped table (bf16), and the decode bench
#   bash benchmarks/ship/h200_house_check.sh OUT before speed   # warm host µs per call, after and before,
#                                                               # alternating, twice; the W1-W3 bench
# (the `before` folder travels untracked; delete it after). The "before" host probe is the earlier
# tree's own script on its own packages, put first on PYTHONPATH.
# Logs go to OUT as one archive. Run from the repository root.
set -uo pipefail
out=$1; before=$(realpath "$2"); step=$3
table=results/tables/nvidia-h200-sm90.yaml
logs=$out/logs; mkdir -p "$logs"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$logs/install.txt" 2>&1
if [ "$step" = tier ]; then
  start=$SECONDS
  DMATTN_TEST_GPU=1 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_cuda_kernels.py tests/test_native.py \
    -k "not test_full_suite" -n 8 > "$logs/gpu-tier.txt" 2>&1
  echo "gpu tier rc $? ($(tail -1 "$logs/gpu-tier.txt")) in $((SECONDS - start)) s"
  start=$SECONDS
  dmattn-bench verify --table $table --suite full --dtype bf16 > "$logs/verify-bf16.txt" 2>&1
  echo "verify bf16 rc $? in $((SECONDS - start)) s: $(grep -i 'worst' "$logs/verify-bf16.txt" | tail -1)"
  start=$SECONDS
  dmattn-bench bench --workloads configs/workloads/peers-decode.yaml --format json > "$logs/h200-decode.json" \
    2> "$logs/bench-decode.txt"
  echo "decode bench rc $? in $((SECONDS - start)) s"
  dmattn-bench bench --from-json "$logs/h200-decode.json" --format markdown --plot "$logs/h200-decode.png" \
    > "$logs/h200-decode.md"
else
  mkdir -p /tmp/before-packages
  ln -sfn "$before/dmattn_bench" /tmp/before-packages/dmattn_bench
  ln -sfn "$before/kernels" /tmp/before-packages/dmattn_kernels
  for round in 1 2; do
    python3 -m benchmarks host-probe --label "after $round" > "$logs/host-after-$round.md" 2> "$logs/host-after-$round.err"
    PYTHONPATH=/tmp/before-packages python3 "$before/benchmarks/host_probe.py" --label "before $round" \
      > "$logs/host-before-$round.md" 2> "$logs/host-before-$round.err"
  done
  start=$SECONDS
  dmattn-bench bench --peers ours-cuda,flex,flex-small-bwd,sdpa-efficient,sdpa-flash-dense,sdpa-cudnn-dense \
    --format json > "$logs/h200.json" 2> "$logs/bench.txt"
  echo "bench rc $? in $((SECONDS - start)) s"
  dmattn-bench bench --from-json "$logs/h200.json" --format markdown --plot "$logs/h200.png" > "$logs/h200.md"
fi
tar czf "$out/$step.tgz" -C "$out" logs && rm -rf "$logs"
