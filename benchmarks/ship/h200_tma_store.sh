#!/usr/bin/env bash
# The forward's tma_store knob (FWD_TMA_STORE) on a lent H200 (its table was not shipped: the
# knob's calls launch from Python, and eager callers lost; results/tables/README.md):
#   bash benchmarks/ship/h200_tma_store.sh OUT tier   # the knob's GPU tier suites (the full suite and
#                                                     # the windows, bf16 and fp16)
#   bash benchmarks/ship/h200_tma_store.sh OUT tune   # W1-W3's forward keys tuned over
#       configs/space/cuda-fwd-ws.yaml (which crosses the knob; Triton given its one config of
#       those keys' class, so that its part costs a trial a key) into the shipped table, then the
#       bench of W1-W3 against Flex and SDPA
#   bash benchmarks/ship/h200_tma_store.sh OUT ab     # as tune, every key timed at its shipped
#       config (128x128 w12 s2 overlap persistent) with and without tma_store (--exhaustive): the
#       ranked tune above ranked the knob out (no journal had timed it)
# Logs (and the table) go to OUT/logs.tgz.
set -uo pipefail
out=$1; step=$2
table=results/tables/nvidia-h200-sm90.yaml
logs=$out/logs; mkdir -p "$logs"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$logs/install.txt" 2>&1
pack() { tar czf "$out/logs.tgz" -C "$out" logs; }
start=$SECONDS
if [ "$step" = tier ]; then
  DMATTN_TEST_GPU=1 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_cuda_kernels.py -k tma_store -n 6 \
    > "$logs/gpu-tier.txt" 2>&1
  echo "gpu tier rc $? ($(tail -1 "$logs/gpu-tier.txt")) in $((SECONDS - start)) s"; pack
  exit
fi
triton_one=$out/triton-fwd-one.yaml
cat > "$triton_one" <<'YAML'
backend: triton
direction: fwd
arch:
  sm90: {block_m: [128], block_n: [64], num_warps: [8], num_stages: [3]}
YAML
space=configs/space/cuda-fwd-ws.yaml; exhaustive=
if [ "$step" = ab ]; then
  space=$out/cuda-fwd-tma-ab.yaml; exhaustive=--exhaustive
  cat > "$space" <<'YAML'
backend: cuda
direction: fwd
arch:
  sm90: {block_m: [128], block_n: [128], num_warps: [12], num_stages: [2], overlap: [1], persistent: [1], tma_store: [0, 1]}
YAML
fi
dmattn-bench tune --backend all --space $space --space "$triton_one" $exhaustive \
  --workloads configs/workloads/peers-tune.yaml --dtype bf16 --suite full --budget 3m --merge $table \
  --out /tmp/h200.yaml --format json > "$logs/tune.json" 2> "$logs/tune.txt"
echo "tune rc $? in $((SECONDS - start)) s"
cp /tmp/h200.yaml $table && cp /tmp/h200.yaml /tmp/h200.yaml.trials.jsonl "$logs/"; pack
start=$SECONDS
dmattn-bench bench --peers ours-cuda,flex,sdpa-flash-dense,sdpa-cudnn-dense --format json > "$logs/h200.json" 2> "$logs/bench.txt"
echo "bench rc $? in $((SECONDS - start)) s"
dmattn-bench bench --from-json "$logs/h200.json" --format markdown > "$logs/h200.md"; pack
