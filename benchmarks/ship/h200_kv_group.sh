#!/usr/bin/env bash
# Issue 56 on a lent H200: the warp-specialized backward's KV group a CTA (BwdConfig.kv_group,
# flash_bwd_ws.cu's BWD_KV_GROUP). Run from the repository root:
#   bash benchmarks/ship/h200_kv_group.sh OUT tune      # the kv-group GPU tests (dense full suite,
#       windows, packed sequences; bf16 and fp16), then the packed grid of
#       configs/workloads/varlen.yaml tuned again into a copy of the shipped table (OUT/<table>),
#       resuming the shipped journal (results/tune/h200-packed.trials.jsonl) without its CUDA
#       trials (their kernel hash is the sources' before the knob): both backends' spaces, the
#       CUDA backward's with kv_group (SKIP_TESTS=1: the tune alone)
#   bash benchmarks/ship/h200_kv_group.sh OUT window IN  # the window grid tuned anew (both backends,
#       the ranked search) and merged into IN/<table>, then where the packed and window steps'
#       time goes (python -m benchmarks profile-step)
#   bash benchmarks/ship/h200_kv_group.sh OUT retune IN  # the dense kv-group GPU tests, then the packed
#       and window grids tuned again from IN/<table>, each resuming its journal of the steps above
#       (IN/packed.trials.jsonl, IN/window.trials.jsonl), so only what they did not time runs,
#       then the profile of the packed and window steps
#   bash benchmarks/ship/h200_kv_group.sh OUT final IN   # kv-group A/B (python -m benchmarks kv-group-ab),
#       the packed grid tuned again from IN/<table> resuming IN/packed.trials.jsonl (its CUDA
#       backward trials printed), then the packed/window bench on the result (BENCH_GROUPS as below)
#   bash benchmarks/ship/h200_kv_group.sh OUT heads-inner  # after the group's heads took turns at each
#       query tile: the kv-group GPU tests, the A/B, the packed grid tuned again (the shipped journal
#       without its CUDA trials, whose kernel hash changed) into a copy of the shipped table, then
#       that table's stale entries (the kv_group ones) re-validated (verify --restamp, bf16)
#   bash benchmarks/ship/h200_kv_group.sh OUT window-order IN  # after windows went back to each head's
#       tiles in turn: the kv-group window GPU tests, IN/<table>'s stale entries re-validated, the A/B
#   bash benchmarks/ship/h200_kv_group.sh OUT bench IN   # the packed/window bench on IN/<table>
#       (h200_varlen_probe.sh's bench step: BENCH_GROUPS="name:seconds ..." picks groups)
set -uo pipefail
out=$1; step=$2
name=nvidia-h200-sm90.yaml
table=$out/$name
spaces="--space configs/space/cuda-fwd-ws.yaml --space configs/space/cuda-bwd-ws.yaml
        --space configs/space/triton-fwd.yaml --space configs/space/triton-bwd.yaml"
mkdir -p "$out"
# the shipped packed journal without its CUDA trials (measured on other CUDA sources: resume refuses them)
shipped_journal_without_cuda() {
  python3 -c "
import json, sys
for line in open('results/tune/h200-packed.trials.jsonl'):
    record = json.loads(line)
    if record.get('backend') != 'cuda' and 'cuda' not in str(record.get('id', '')).split('|'):
        sys.stdout.write(line)
"
}
# a journal's timed CUDA backward trials: id and GPU ms
cuda_backward_trials() {
  grep '"backend": "cuda"' "$1" | grep '"direction": "bwd"' | grep '"status": "ok"' | \
    python3 -c "import sys, json; [print(r['id'], r['median_ms']) for r in map(json.loads, sys.stdin)]"
}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install-$step.txt" 2>&1
if [ "$step" = tune ]; then
  if [ -z "${SKIP_TESTS:-}" ]; then
    start=$SECONDS
    DMATTN_TEST_GPU=1 timeout 260 python3 -m pytest -q -m gpu tests/test_gpu.py -n 8 -k "kv_group or kv-group" \
      > "$out/gpu-kv-group.txt" 2>&1
    echo "gpu kv-group tests rc $? ($(tail -1 "$out/gpu-kv-group.txt")) in $((SECONDS - start)) s"
    grep -E "^FAILED|^ERROR|Error|assert" "$out/gpu-kv-group.txt" | head -20
  fi
  shipped_journal_without_cuda > "$table.trials.jsonl"
  start=$SECONDS
  timeout 280 dmattn-bench tune --workloads configs/workloads/varlen.yaml --grid packed --backend all --suite full \
    $spaces --resume --merge results/tables/$name --out "$table" --format json > "$out/tune-packed.json" \
    2> "$out/tune-packed.txt"
  echo "packed tune rc $? in $((SECONDS - start)) s"
  grep -v "^tune \[" "$out/tune-packed.txt" | tail -16
elif [ "$step" = window ]; then
  cp "$3/$name" "$table"
  start=$SECONDS
  timeout 330 dmattn-bench tune --workloads configs/workloads/varlen.yaml --grid window --backend all --suite full \
    $spaces --merge "$table" --out "$table" --format json > "$out/tune-window.json" 2> "$out/tune-window.txt"
  echo "window tune rc $? in $((SECONDS - start)) s"
  grep -v "^tune \[" "$out/tune-window.txt" | tail -16
  cp "$table" results/tables/$name
  timeout 150 python3 -m benchmarks profile-step results/tables/$name --workloads configs/workloads/packed.yaml \
    --only packed-causal window 2>&1 | grep -v Warning | tail -40
elif [ "$step" = retune ]; then
  start=$SECONDS
  DMATTN_TEST_GPU=1 timeout 120 python3 -m pytest -q -m gpu tests/test_gpu.py -n 4 -k "kv_group_backward_passes" \
    > "$out/gpu-kv-group.txt" 2>&1
  echo "gpu kv-group dense tests rc $? ($(tail -1 "$out/gpu-kv-group.txt")) in $((SECONDS - start)) s"
  grep -E "^FAILED|^ERROR|^E  " "$out/gpu-kv-group.txt" | head -10
  mkdir -p "$out/packed"
  cp "$3/packed.trials.jsonl" "$out/packed/$name.trials.jsonl"
  cp "$3/window.trials.jsonl" "$table.trials.jsonl"
  for grid in packed window; do
    if [ $grid = packed ]; then merge=$3/$name; into=$out/packed/$name; else merge=$out/packed/$name; into=$table; fi
    start=$SECONDS
    timeout 200 dmattn-bench tune --workloads configs/workloads/varlen.yaml --grid $grid --backend all --suite full \
      $spaces --resume --merge "$merge" --out "$into" --format json > "$out/tune-$grid.json" 2> "$out/tune-$grid.txt"
    echo "$grid tune rc $? in $((SECONDS - start)) s"
    grep -v "^tune \[" "$out/tune-$grid.txt" | tail -8
  done
  cp "$table" results/tables/$name
  timeout 150 python3 -m benchmarks profile-step results/tables/$name --workloads configs/workloads/packed.yaml \
    --only packed-causal window 2>&1 | grep -v Warning | tail -40
elif [ "$step" = heads-inner ]; then
  start=$SECONDS
  DMATTN_TEST_GPU=1 timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py -n 8 -k "kv_group or kv-group" \
    > "$out/gpu-kv-group.txt" 2>&1
  status=$?
  echo "gpu kv-group tests rc $status ($(tail -1 "$out/gpu-kv-group.txt")) in $((SECONDS - start)) s"
  grep -E "^FAILED|^ERROR|^E  " "$out/gpu-kv-group.txt" | head -10
  [ $status = 0 ] || exit 1
  start=$SECONDS
  timeout 150 python3 -m benchmarks kv-group-ab > "$out/kv-group-ab.md" 2> "$out/kv-group-ab.err"
  echo "kv-group A/B rc $? in $((SECONDS - start)) s"; cat "$out/kv-group-ab.md"
  shipped_journal_without_cuda > "$table.trials.jsonl"
  start=$SECONDS
  timeout 150 dmattn-bench tune --workloads configs/workloads/varlen.yaml --grid packed --backend all --suite full \
    $spaces --resume --merge results/tables/$name --out "$table" --format json > "$out/tune-packed.json" \
    2> "$out/tune-packed.txt"
  echo "packed tune rc $? in $((SECONDS - start)) s"
  grep -v "^tune \[" "$out/tune-packed.txt" | tail -4
  cuda_backward_trials "$table.trials.jsonl"
  start=$SECONDS
  timeout 150 dmattn-bench verify --table "$table" --suite full --dtype bf16 --restamp > "$out/verify-bf16.txt" 2>&1
  echo "verify --restamp bf16 rc $? in $((SECONDS - start)) s"
  tail -6 "$out/verify-bf16.txt"
elif [ "$step" = window-order ]; then  # IN/<table>'s stale entries (the window kv_group ones) re-validated
  cp "$3/$name" "$table"
  start=$SECONDS
  DMATTN_TEST_GPU=1 timeout 120 python3 -m pytest -q -m gpu tests/test_gpu.py -n 8 -k "kv-group and windows" \
    > "$out/gpu-kv-group.txt" 2>&1
  status=$?
  echo "gpu kv-group window tests rc $status ($(tail -1 "$out/gpu-kv-group.txt")) in $((SECONDS - start)) s"
  [ $status = 0 ] || exit 1
  start=$SECONDS
  timeout 100 dmattn-bench verify --table "$table" --suite full --dtype bf16 --restamp > "$out/verify-bf16.txt" 2>&1
  echo "verify --restamp bf16 rc $? in $((SECONDS - start)) s"
  tail -5 "$out/verify-bf16.txt"
  timeout 100 python3 -m benchmarks kv-group-ab > "$out/kv-group-ab.md" 2> "$out/kv-group-ab.err"
  echo "kv-group A/B rc $?"; cat "$out/kv-group-ab.md"
elif [ "$step" = final ]; then
  start=$SECONDS
  timeout 150 python3 -m benchmarks kv-group-ab > "$out/kv-group-ab.md" 2> "$out/kv-group-ab.err"
  echo "kv-group A/B rc $? in $((SECONDS - start)) s"; cat "$out/kv-group-ab.md"; tail -3 "$out/kv-group-ab.err"
  cp "$3/packed.trials.jsonl" "$table.trials.jsonl"
  start=$SECONDS
  timeout 120 dmattn-bench tune --workloads configs/workloads/varlen.yaml --grid packed --backend all --suite full \
    $spaces --resume --merge "$3/$name" --out "$table" --format json > "$out/tune-packed.json" 2> "$out/tune-packed.txt"
  echo "packed tune rc $? in $((SECONDS - start)) s"
  grep -v "^tune \[" "$out/tune-packed.txt" | tail -4
  cuda_backward_trials "$table.trials.jsonl"
  cp "$table" results/tables/$name
  BENCH_GROUPS=${BENCH_GROUPS:-"packed-causal:170 window:190"} bash benchmarks/ship/h200_varlen_probe.sh "$out" bench
else
  cp "$3/$name" results/tables/$name
  exec bash benchmarks/ship/h200_varlen_probe.sh "$out" bench
fi
