#!/usr/bin/env bash
# Issue 56 on a lent H200: the CUDA forward's sliding window (HAS_WINDOW). Run from the repository root:
#   bash benchmarks/ship/h200_window_cuda.sh OUT tune    # the window GPU tests, then tunes
#       configs/workloads/varlen.yaml with both backends into a copy of the shipped table (OUT/<table>)
#   bash benchmarks/ship/h200_window_cuda.sh OUT ws IN   # resumes IN/<table>'s tune (its journal beside it)
#       with the warp-specialized CUDA forward's grid (configs/space/cuda-fwd-ws.yaml: its knobs, the
#       overlapped kernel that takes a window), then benches the window group on the result
#   bash benchmarks/ship/h200_window_cuda.sh OUT bwd     # the warp-specialized backward's window GPU
#       tests, then resumes the shipped varlen tune's journal (results/tune/h200-varlen.trials.jsonl,
#       its CUDA trials dropped: they were measured on the sources before the backward's window)
#       with the backward's spaces (configs/space/cuda-bwd-ws.yaml beside Triton's) into OUT/<table>
#   bash benchmarks/ship/h200_window_cuda.sh OUT bench IN  # the packed/window bench on IN/<table>
#       (h200_varlen_probe.sh's bench step: BENCH_GROUPS="name:seconds ..." picks groups)
set -uo pipefail
out=$1; step=$2
name=nvidia-h200-sm90.yaml
table=$out/$name
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install-$step.txt" 2>&1
if [ "$step" = tune ]; then
  start=$SECONDS
  DMATTN_TEST_GPU=1 timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py -k "window" -n 6 \
    > "$out/gpu-window.txt" 2>&1
  echo "gpu window tests rc $? ($(tail -1 "$out/gpu-window.txt")) in $((SECONDS - start)) s"
  start=$SECONDS
  timeout 330 dmattn-bench tune --workloads configs/workloads/varlen.yaml --backend all --suite full \
    --merge results/tables/$name --out "$table" --format json > "$out/tune.json" 2> "$out/tune.txt"
  echo "tune rc $? in $((SECONDS - start)) s"
  tail -40 "$out/tune.txt"
elif [ "$step" = ws ]; then
  cp "$3/$name" "$3/$name.trials.jsonl" "$out/"
  start=$SECONDS
  timeout 300 dmattn-bench tune --workloads configs/workloads/varlen.yaml --backend all --suite full \
    --space configs/space/cuda-fwd-ws.yaml --resume --merge results/tables/$name --out "$table" --format json \
    > "$out/tune-ws.json" 2> "$out/tune-ws.txt"
  echo "ws tune rc $? in $((SECONDS - start)) s"
  grep -v "^tune \[" "$out/tune-ws.txt" | tail -12
  cp "$table" results/tables/$name
  start=$SECONDS
  timeout 220 dmattn-bench bench --workloads configs/workloads/packed.yaml --only window --format json \
    > "$out/bench-window.json" 2> "$out/bench-window.txt"
  echo "bench window rc $? in $((SECONDS - start)) s"
  dmattn-bench bench --from-json "$out/bench-window.json" --format markdown | grep -E "^\| window" | cut -c1-200
elif [ "$step" = bwd ]; then
  start=$SECONDS
  DMATTN_TEST_GPU=1 timeout 240 python3 -m pytest -q -m gpu tests/test_gpu.py \
    -k "backward_runs_the_full_suite_s_windows" -n 4 > "$out/gpu-window-bwd.txt" 2>&1
  echo "gpu window backward tests rc $? ($(tail -1 "$out/gpu-window-bwd.txt")) in $((SECONDS - start)) s"
  python3 -c "
import json, sys
for line in open('results/tune/h200-varlen.trials.jsonl'):
    record = json.loads(line)
    if record.get('backend') != 'cuda' and not str(record.get('id', '')).endswith('|cuda'):
        sys.stdout.write(line)
" > "$table.trials.jsonl"
  start=$SECONDS
  timeout 300 dmattn-bench tune --workloads configs/workloads/varlen.yaml --backend all --suite full \
    --space configs/space/cuda-bwd-ws.yaml --space configs/space/triton-bwd.yaml --resume \
    --merge results/tables/$name --out "$table" --format json > "$out/tune-bwd.json" 2> "$out/tune-bwd.txt"
  echo "bwd tune rc $? in $((SECONDS - start)) s"
  grep -v "^tune \[" "$out/tune-bwd.txt" | tail -12
else  # the packed/window bench, a group a run (h200_varlen_probe.sh's bench step)
  cp "$3/$name" results/tables/$name
  exec bash benchmarks/ship/h200_varlen_probe.sh "$out" bench
fi
