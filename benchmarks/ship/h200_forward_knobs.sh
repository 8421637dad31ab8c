#!/usr/bin/env bash
# Ships the warp-specialized forward's knobs on the H200 table, as run on a lent H200:
#   bash benchmarks/ship/h200_forward_knobs.sh OUT tune    # tune W1-W3's forward keys over the knobs, then
#                                                          # the GPU tier and `verify --suite full` (bf16, fp16)
#   bash benchmarks/ship/h200_forward_knobs.sh OUT bench   # the bench report of the shipped table
# Logs and the new table go to OUT (one archive: the device tool brings back few files).
set -uo pipefail
out=$1; step=$2
table=results/tables/nvidia-h200-sm90.yaml
logs=$out/logs; mkdir -p "$logs"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$logs/install.txt" 2>&1
if [ "$step" = tune ]; then
  start=$SECONDS
  dmattn-bench tune --backend all --space configs/space/cuda-fwd-ws.yaml --workloads configs/workloads/peers-tune.yaml \
    --dtype bf16 --suite full --merge $table --out /tmp/h200.yaml --format json > "$logs/tune.json" 2> "$logs/tune.txt"
  echo "tune rc $? in $((SECONDS - start)) s"
  cp /tmp/h200.yaml $table && cp /tmp/h200.yaml /tmp/h200.yaml.trials.jsonl "$logs/"
  start=$SECONDS
  DMATTN_TEST_GPU=1 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_cuda_kernels.py tests/test_native.py \
    -k "not test_full_suite" -n 8 > "$logs/gpu-tier.txt" 2>&1 &
  tier=$!
  for dtype in bf16 fp16; do
    dmattn-bench verify --table $table --suite full --dtype $dtype > "$logs/verify-$dtype.txt" 2>&1
    echo "verify $dtype rc $?"
  done
  wait $tier; echo "gpu tier rc $? ($(tail -1 "$logs/gpu-tier.txt")) in $((SECONDS - start)) s"
else
  start=$SECONDS
  dmattn-bench bench --peers ours-cuda,flex,flex-small-bwd,sdpa-efficient,sdpa-flash-dense,sdpa-cudnn-dense \
    --format json > "$logs/h200.json" 2> "$logs/bench.txt"
  echo "bench rc $? in $((SECONDS - start)) s"
  dmattn-bench bench --from-json "$logs/h200.json" --format markdown --plot "$logs/h200.png" > "$logs/h200.md"
fi
tar czf "$out/$step.tgz" -C "$out" logs && rm -rf "$logs"
