#!/usr/bin/env bash
# Issue 56 on a lent H200: packed sequences in the CUDA kernels (PACKED: the overlapped forward and
# the warp-specialized backward). Run from the repository root:
#   bash benchmarks/ship/h200_packed_cuda.sh OUT tune   # the CUDA packed and window GPU tests (forward
#       and backward: the backward's packed helpers moved to sm90.cuh), then the packed grid of
#       configs/workloads/varlen.yaml tuned again into a copy of the shipped table (OUT/<table>),
#       resuming the shipped journal (results/tune/h200-packed.trials.jsonl) without its CUDA
#       trials, which ran on the sources before: the CUDA forward's grid joins both backends'
#       (SKIP_TESTS=1: the tune alone)
#   bash benchmarks/ship/h200_packed_cuda.sh OUT verify  # the same GPU tests, then the shipped
#       table's stale entries re-validated (verify --restamp, bf16) into OUT/<table>
#   bash benchmarks/ship/h200_packed_cuda.sh OUT bench IN  # the packed bench groups on IN/<table>
#       (h200_varlen_probe.sh's bench step; BENCH_GROUPS="name:seconds ..." picks groups)
set -uo pipefail
out=$1; step=$2
name=nvidia-h200-sm90.yaml
table=$out/$name
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install-$step.txt" 2>&1
if [ "$step" != bench ] && [ -z "${SKIP_TESTS:-}" ]; then  # SKIP_TESTS=1: they passed on the same code
  start=$SECONDS
  DMATTN_TEST_GPU=1 timeout 220 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_gpu_varlen.py -n 6 \
    -k "runs_the_full_suite_s_packed or forward_runs_the_full_suite_s_windows or test_packed_documents_within_bound" \
    > "$out/gpu-packed.txt" 2>&1
  echo "gpu packed/window tests rc $? ($(tail -1 "$out/gpu-packed.txt")) in $((SECONDS - start)) s"
  grep -E "^FAILED|^ERROR" "$out/gpu-packed.txt" | head -20
fi
if [ "$step" = verify ]; then
  cp results/tables/$name "$table"
  start=$SECONDS
  timeout 400 dmattn-bench verify --table "$table" --suite full --dtype bf16 --restamp > "$out/verify-bf16.txt" 2>&1
  echo "verify --restamp bf16 rc $? in $((SECONDS - start)) s"
  tail -8 "$out/verify-bf16.txt"
elif [ "$step" = tune ]; then
  python3 -c "
import json, sys
for line in open('results/tune/h200-packed.trials.jsonl'):
    record = json.loads(line)
    if record.get('backend') != 'cuda' and 'cuda' not in str(record.get('id', '')).split('|'):
        sys.stdout.write(line)
" > "$table.trials.jsonl"
  start=$SECONDS
  timeout 330 dmattn-bench tune --workloads configs/workloads/varlen.yaml --grid packed --backend all --suite full \
    --space configs/space/cuda-fwd-ws.yaml --space configs/space/cuda-bwd-ws.yaml \
    --space configs/space/triton-fwd.yaml --space configs/space/triton-bwd.yaml --resume \
    --merge results/tables/$name --out "$table" --format json > "$out/tune-packed.json" 2> "$out/tune-packed.txt"
  echo "packed tune rc $? in $((SECONDS - start)) s"
  grep -v "^tune \[" "$out/tune-packed.txt" | tail -14
else
  cp "$3/$name" results/tables/$name
  exec bash benchmarks/ship/h200_varlen_probe.sh "$out" bench
fi
