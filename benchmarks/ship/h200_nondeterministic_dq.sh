#!/usr/bin/env bash
# The warp-specialized backward's nondeterministic_dq knob (flash_bwd_ws.cu's BWD_DQ_UNORDERED: dQ
# shares added in no set order) into the H200 table, on a lent H200:
#   bash benchmarks/ship/h200_nondeterministic_dq.sh OUT tune   # the knob's GPU tier suites (the full
#       suite, the transposed layout, the KV group, windows and packed sequences, bf16 and fp16;
#       a call that must be deterministic running it in order); then W1-W3's backward keys timed
#       at their shipped config (64x128 w12 s2, kv_group where GQA) with and without the knob
#       (`tune --exhaustive`, Triton given one config, a trial a key), merged into the shipped
#       table (OUT/logs/<table>); then the table's nondeterministic_dq entries verified with the
#       full suite in bf16 and, as fp16 keys, in fp16
#   bash benchmarks/ship/h200_nondeterministic_dq.sh OUT bench [JOURNAL]  # with JOURNAL (the tune
#       step's, results/tune/h200-nondeterministic-dq.trials.jsonl) that tune resumed first, so
#       the shipped table gets its entries without timing anything again; then W1-W3 against every
#       peer on the table (OUT/h200.{json,md,png}: results/bench/)
# Logs (and the table) go to OUT/logs.tgz.
set -uo pipefail
out=$1; step=$2
table=results/tables/nvidia-h200-sm90.yaml
logs=$out/logs; mkdir -p "$logs"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$logs/install.txt" 2>&1
pack() { tar czf "$out/logs.tgz" -C "$out" logs; }
# W1-W3's backward keys at their shipped config with and without the knob, merged into the table
ab_tune() {
  cat > "$out/triton-bwd-one.yaml" <<'YAML'
backend: triton
direction: bwd
arch:
  sm90: {block_m: [64], block_n: [64], block_m_dq: [64], block_n_dq: [64], num_warps: [4], num_stages: [2]}
YAML
  cat > "$out/cuda-bwd-dq-ab.yaml" <<'YAML'
backend: cuda
direction: bwd
arch:
  sm90: {block_m: [64], block_n: [128], block_m_dq: [64], block_n_dq: [128], num_warps: [12], num_stages: [2],
         kv_group: [0, 1], nondeterministic_dq: [0, 1]}
YAML
  timeout 200 dmattn-bench tune --backend all --space "$out/cuda-bwd-dq-ab.yaml" --space "$out/triton-bwd-one.yaml" \
    --exhaustive --workloads configs/workloads/peers-tune.yaml --dtype bf16 --suite full --budget 3m --merge $table \
    --out /tmp/nvidia-h200-sm90.yaml "$@" --format json > "$logs/tune.json" 2> "$logs/tune.txt"
  echo "tune rc $? in $((SECONDS - start)) s"
  cp /tmp/nvidia-h200-sm90.yaml $table && cp /tmp/nvidia-h200-sm90.yaml /tmp/nvidia-h200-sm90.yaml.trials.jsonl "$logs/"
  pack
}
start=$SECONDS
if [ "$step" = bench ]; then
  if [ -n "${3:-}" ]; then
    cp "$3" /tmp/nvidia-h200-sm90.yaml.trials.jsonl
    ab_tune --resume
    start=$SECONDS
  fi
  dmattn-bench bench --peers ours-cuda,flex,flex-small-bwd,sdpa-efficient,sdpa-flash-dense,sdpa-cudnn-dense \
    --format json > "$out/h200.json" 2> "$logs/bench.txt"
  echo "bench rc $? in $((SECONDS - start)) s"
  dmattn-bench bench --from-json "$out/h200.json" --format markdown > "$out/h200.md"
  dmattn-bench bench --from-json "$out/h200.json" --plot "$out/h200.png" > /dev/null; pack
  exit
fi
DMATTN_TEST_GPU=1 timeout 330 python3 -m pytest -q -m gpu tests/test_gpu.py -k nondeterministic -n 8 -rA \
  > "$logs/gpu-tier.txt" 2>&1
echo "gpu tier rc $? ($(tail -1 "$logs/gpu-tier.txt")) in $((SECONDS - start)) s"; pack
grep -E "^FAILED|^ERROR" "$logs/gpu-tier.txt" | head
start=$SECONDS
ab_tune
grep '"direction": "bwd"' "$logs/nvidia-h200-sm90.yaml.trials.jsonl" | grep '"status": "ok"' | python3 -c "
import sys, json
for r in map(json.loads, sys.stdin):
    print(r['id'], r['median_ms'])"
python3 -m benchmarks knob-entries "$table" nondeterministic_dq "$out/nondeterministic-entries.yaml"
for dtype in bf16 fp16; do
  start=$SECONDS
  timeout 100 dmattn-bench verify --table "$out/nondeterministic-entries.yaml" --dtype $dtype --suite full --no-ledger \
    > "$logs/verify-$dtype.txt" 2>&1
  echo "verify $dtype rc $? in $((SECONDS - start)) s: $(tail -1 "$logs/verify-$dtype.txt")"
done
pack
