#!/usr/bin/env bash
# A change to the overlapped forward's code (flash_fwd_ws.cu or fwd_steps.cuh under FWD_OVERLAP:
# the rescale threshold, the one-test reach of `scores`) shipped on a lent H200:
#   bash benchmarks/ship/h200_overlap_change.sh OUT tier [EXPR]   # the overlapped forward's GPU tier
#       suites (full suite, windows, packed sequences, bf16 and fp16) and its native programs; EXPR
#       (pytest -k) narrows them, e.g. "not windows" for a change under `!HAS_WINDOW`
#   bash benchmarks/ship/h200_overlap_change.sh OUT ship   # the H200 table's entries whose code changed
#       (its overlapped forward entries) verified with the full suite and restamped, then W1-W3
#       against every peer on the table (results/bench/h200.{json,md,png})
# Logs go to OUT/logs.tgz.
set -uo pipefail
out=$1; step=$2; narrow=${3:-}
source "$(dirname "$0")/h200_setup.sh"
start=$SECONDS
if [ "$step" = tier ]; then
  DMATTN_TEST_GPU=1 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_cuda_kernels.py \
    -k "(overlap or native_program)${narrow:+ and ($narrow)}" -n 8 -rA > "$logs/gpu-tier.txt" 2>&1
  echo "gpu tier rc $? ($(tail -1 "$logs/gpu-tier.txt")) in $((SECONDS - start)) s"; pack
  exit
fi
dmattn-bench verify --table $table --suite full --dtype bf16 --restamp > "$logs/verify-restamp.txt" 2>&1
echo "verify --restamp rc $? in $((SECONDS - start)) s: $(grep -c ': ok' "$logs/verify-restamp.txt") cases ok"
cp $table "$out/"; pack
start=$SECONDS
dmattn-bench bench --peers ours-cuda,flex,flex-small-bwd,sdpa-efficient,sdpa-flash-dense,sdpa-cudnn-dense \
  --format json > "$out/h200.json" 2> "$logs/bench.txt"
echo "bench rc $? in $((SECONDS - start)) s"
dmattn-bench bench --from-json "$out/h200.json" --format markdown > "$out/h200.md"
dmattn-bench bench --from-json "$out/h200.json" --plot "$out/h200.png" > /dev/null; pack
