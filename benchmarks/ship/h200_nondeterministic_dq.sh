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
#   bash benchmarks/ship/h200_nondeterministic_dq.sh OUT rest ws128|d192|kv_group   # the same for
#       the table's other warp-specialized CUDA backward keys: ws128 the sweep's 18 on 64x128 w12
#       s2; d192 its two D192 keys on 64x96 w12 s1; kv_group the D128 window and packed keys on
#       64x128 w12 s2 kv_group; the last two then verify every nondeterministic_dq entry (run each
#       on the table the one before wrote; journals OUT/logs/rest-*.trials.jsonl)
#   bash benchmarks/ship/h200_nondeterministic_dq.sh OUT bench [JOURNAL]  # with JOURNAL (the tune
#       step's, results/tune/h200-nondeterministic-dq.trials.jsonl) that tune resumed first, so
#       the shipped table gets its entries without timing anything again; then W1-W3 against every
#       peer on the table (OUT/h200.{json,md,png}: results/bench/)
# Logs (and the table) go to OUT/logs.tgz.
set -uo pipefail
out=$1; step=$2
source "$(dirname "$0")/h200_setup.sh"
cat > "$out/triton-bwd-one.yaml" <<'YAML'
backend: triton
direction: bwd
arch:
  sm90: {block_m: [64], block_n: [64], block_m_dq: [64], block_n_dq: [64], num_warps: [4], num_stages: [2]}
YAML
# ab_tune NAME SPACE WORKLOADS GRID SECONDS [tune options]: the keys of WORKLOADS' GRID timed at
# the warp-specialized backward config SPACE gives (sm90 axes, the knob crossed) and Triton's one,
# merged into the shipped table, which it then replaces (a copy and the journal in OUT/logs)
ab_tune() {
  local name=$1 space=$2 workloads=$3 grid=$4 seconds=$5; shift 5
  printf 'backend: cuda\ndirection: bwd\narch:\n  sm90: %s\n' "$space" > "$out/cuda-$name.yaml"
  timeout "$seconds" dmattn-bench tune --backend all --space "$out/cuda-$name.yaml" --space "$out/triton-bwd-one.yaml" \
    --exhaustive --workloads "$workloads" --grid "$grid" --dtype bf16 --suite full --budget 7m --merge $table \
    --out "/tmp/$name.yaml" "$@" --format json > "$logs/$name.json" 2> "$logs/$name.txt"
  echo "tune $name rc $? in $((SECONDS - start)) s"
  cp "/tmp/$name.yaml" $table && cp "/tmp/$name.yaml" "/tmp/$name.yaml.trials.jsonl" "$logs/"
  grep '"direction": "bwd"' "/tmp/$name.yaml.trials.jsonl" | grep '"status": "ok"' | python3 -c "
import sys, json
for r in map(json.loads, sys.stdin):
    print(r['id'], r['median_ms'])"
  pack
}
verify_knob_entries() {
  python3 -m benchmarks knob-entries "$table" nondeterministic_dq "$out/nondeterministic-entries.yaml"
  for dtype in bf16 fp16; do
    start=$SECONDS
    timeout 200 dmattn-bench verify --table "$out/nondeterministic-entries.yaml" --dtype $dtype --suite full --no-ledger \
      > "$logs/verify-$dtype.txt" 2>&1
    echo "verify $dtype rc $? in $((SECONDS - start)) s: $(tail -1 "$logs/verify-$dtype.txt")"
  done
  pack
}
WS_128="{block_m: [64], block_n: [128], block_m_dq: [64], block_n_dq: [128], num_warps: [12], num_stages: [2]"
PEERS_SPACE="$WS_128, kv_group: [0, 1], nondeterministic_dq: [0, 1]}"  # W1-W3's keys: the tune and bench steps
start=$SECONDS
case $step in
  tune)
    DMATTN_TEST_GPU=1 timeout 330 python3 -m pytest -q -m gpu tests/test_gpu.py -k nondeterministic -n 8 -rA \
      > "$logs/gpu-tier.txt" 2>&1
    echo "gpu tier rc $? ($(tail -1 "$logs/gpu-tier.txt")) in $((SECONDS - start)) s"; pack
    grep -E "^FAILED|^ERROR" "$logs/gpu-tier.txt" | head
    start=$SECONDS
    ab_tune nvidia-h200-sm90 "$PEERS_SPACE" configs/workloads/peers-tune.yaml default 200
    verify_knob_entries ;;
  rest)
    # the table's CUDA backward keys that W1-W3 leave out (ws128 and d192: default.yaml's `sweep`
    # grid and the GQA 1 / 8 rows of `shipped`; kv_group: varlen.yaml's), each listed: a key whose
    # entry is Triton's stays out, as the merged tune would replace it by the best of these few
    # candidates
    cat > "$out/rest.yaml" <<'YAML'
ws128:
  - {tokens: 16384, heads: 16, head_dim: [80, 96], seqlen: [4096], causal: [true, false], gqa_ratio: [4],
     variants: [{mask: none, bias: none}], dtype: [bf16]}
  - {tokens: 16384, heads: 16, head_dim: [96], seqlen: [1536], causal: [false], gqa_ratio: [2],
     variants: [{mask: per_key, bias: per_key, bias_grad: true}, {mask: kv_head, bias: per_key, bias_grad: true}],
     dtype: [bf16]}
  - {tokens: 16384, heads: 16, head_dim: [128], seqlen: [4096], causal: [false], gqa_ratio: [4],
     variants: [{mask: kv_head, bias: kv_head}, {mask: kv_head, bias: per_key, bias_grad: true},
                {mask: per_key, bias: per_key, bias_grad: true}], dtype: [bf16]}
  - {tokens: 16384, heads: 16, head_dim: [128], seqlen: [4096], causal: [true], gqa_ratio: [4],
     variants: [{mask: kv_head, bias: kv_head}, {mask: none, bias: full}, {mask: none, bias: per_key, bias_grad: true},
                {mask: per_key, bias: per_key, bias_grad: true}], dtype: [bf16]}
  - {tokens: 16384, heads: 16, head_dim: [128], seqlen: [1024], causal: [true], gqa_ratio: [1],
     variants: [{mask: kv_head, bias: per_key, bias_grad: true}], dtype: [bf16]}
  - {tokens: 16384, heads: 16, head_dim: [128], seqlen: [4096], causal: [true], gqa_ratio: [8],
     variants: [{mask: kv_head, bias: per_key, bias_grad: true}], dtype: [bf16]}
  - {tokens: 16384, heads: 8, head_dim: [128], seqlen: [16384], causal: [true], gqa_ratio: [1, 4, 8],
     variants: [{mask: kv_head, bias: per_key, bias_grad: true}], dtype: [bf16]}
d192:
  - {tokens: 16384, heads: 16, head_dim: [192], seqlen: [4096], causal: [true, false], gqa_ratio: [4],
     variants: [{mask: none, bias: none}], dtype: [bf16]}
kv_group:  # varlen.yaml's D128 window keys and its packed one without mask or bias
  - {tokens: 16384, heads: 16, head_dim: [128], seqlen: [8192], window: [[1023, 0]], causal: [true], gqa_ratio: [4],
     variants: [{mask: none, bias: none}, {mask: none, bias: per_key, bias_grad: true}], dtype: [bf16]}
  - {heads: 16, head_dim: [128], documents: [[4096, 700, 2900, 1500, 3100, 1024, 1964, 1100]], causal: [true],
     gqa_ratio: [4], variants: [{mask: none, bias: none}], dtype: [bf16]}
YAML
    case ${3:-} in
      ws128) ab_tune rest-ws128 "$WS_128, kv_group: [0], nondeterministic_dq: [0, 1]}" "$out/rest.yaml" ws128 560 ;;
      kv_group)
        ab_tune rest-kv-group "$WS_128, kv_group: [1], nondeterministic_dq: [0, 1]}" "$out/rest.yaml" kv_group 200
        verify_knob_entries ;;
      d192)
        ab_tune rest-d192 "{block_m: [64], block_n: [96], block_m_dq: [64], block_n_dq: [96], num_warps: [12], \
num_stages: [1], kv_group: [0], nondeterministic_dq: [0, 1]}" "$out/rest.yaml" d192 150
        verify_knob_entries ;;
      *) echo "rest: ws128, d192 or kv_group (got '${3:-}')" >&2; exit 2 ;;
    esac ;;
  bench)
    if [ -n "${3:-}" ]; then
      cp "$3" /tmp/nvidia-h200-sm90.yaml.trials.jsonl
      ab_tune nvidia-h200-sm90 "$PEERS_SPACE" configs/workloads/peers-tune.yaml default 200 --resume
      start=$SECONDS
    fi
    dmattn-bench bench --peers ours-cuda,flex,flex-small-bwd,sdpa-efficient,sdpa-flash-dense,sdpa-cudnn-dense \
      --format json > "$out/h200.json" 2> "$logs/bench.txt"
    echo "bench rc $? in $((SECONDS - start)) s"
    dmattn-bench bench --from-json "$out/h200.json" --format markdown > "$out/h200.md"
    dmattn-bench bench --from-json "$out/h200.json" --plot "$out/h200.png" > /dev/null; pack ;;
  *) echo "step: tune, rest or bench (got $step)" >&2; exit 2 ;;
esac
