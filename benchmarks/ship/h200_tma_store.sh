#!/usr/bin/env bash
# The forward's tma_store knob (FWD_TMA_STORE) into the H200 table, on a lent H200:
#   bash benchmarks/ship/h200_tma_store.sh OUT   # the knob's GPU tier suites (the full suite and
#       the windows, bf16 and fp16) and the CUDA forward's native programs (out's map moved to each
#       run's allocation); then W1-W3's forward keys timed at their shipped config (128x128 w12 s2
#       overlap persistent) with and without tma_store (`tune --exhaustive`: a ranked tune ranks an
#       untimed knob out; Triton given one config of those keys' class, a trial a key), merged into
#       the shipped table; then the table's tma_store entries verified with the full suite in bf16
#       and, as fp16 keys, in fp16
# (the bench of W1-W3 on the table: h200_overlap_change.sh OUT ship)
# Logs (and the table) go to OUT/logs.tgz.
set -uo pipefail
out=$1
source "$(dirname "$0")/h200_setup.sh"
start=$SECONDS
DMATTN_TEST_GPU=1 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_cuda_kernels.py \
  -k "tma_store or native_program" -n 6 > "$logs/gpu-tier.txt" 2>&1
echo "gpu tier rc $? ($(tail -1 "$logs/gpu-tier.txt")) in $((SECONDS - start)) s"; pack
start=$SECONDS
cat > "$out/triton-fwd-one.yaml" <<'YAML'
backend: triton
direction: fwd
arch:
  sm90: {block_m: [128], block_n: [64], num_warps: [8], num_stages: [3]}
YAML
cat > "$out/cuda-fwd-tma-ab.yaml" <<'YAML'
backend: cuda
direction: fwd
arch:
  sm90: {block_m: [128], block_n: [128], num_warps: [12], num_stages: [2], overlap: [1], persistent: [1], tma_store: [0, 1]}
YAML
dmattn-bench tune --backend all --space "$out/cuda-fwd-tma-ab.yaml" --space "$out/triton-fwd-one.yaml" --exhaustive \
  --workloads configs/workloads/peers-tune.yaml --dtype bf16 --suite full --budget 3m --merge $table \
  --out /tmp/nvidia-h200-sm90.yaml --format json > "$logs/tune.json" 2> "$logs/tune.txt"
echo "tune rc $? in $((SECONDS - start)) s"
cp /tmp/nvidia-h200-sm90.yaml $table && cp /tmp/nvidia-h200-sm90.yaml.trials.jsonl "$logs/"; pack
python3 -m benchmarks knob-entries "$table" tma_store "$out/tma-store-entries.yaml"
for dtype in bf16 fp16; do
  start=$SECONDS
  dmattn-bench verify --table "$out/tma-store-entries.yaml" --dtype $dtype --suite full --no-ledger \
    > "$logs/verify-$dtype.txt" 2>&1
  echo "verify $dtype rc $? in $((SECONDS - start)) s: $(tail -1 "$logs/verify-$dtype.txt")"
done
pack
