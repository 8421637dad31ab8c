#!/usr/bin/env bash
# The shipped table of this GPU, in steps that fit a time-limited session:
#   tune          the `shipped` grid of configs/workloads/default.yaml (bf16 + fp16), resuming
#                 from results/tune/NAME-shipped-grid.trials.jsonl when it exists and writing the
#                 journal back there; stopped with SIGINT after $TUNE_SECONDS (default 540), the
#                 journal keeps every finished trial. A finished tune writes
#                 results/tables/<this GPU's slug>.yaml.
#   decode        the `shipped` grid of configs/workloads/decode.yaml (KV-cache shapes: the
#                 short-query forward's keys), merged into this GPU's table (`tune --merge`).
#   verify-bf16   `verify --suite full --restamp` of that table in bf16 (and verify-fp16).
#   learn-defaults  configs/defaults.yaml learned again (`python -m benchmarks learn-defaults`) from
#                 the journals and validated tables configs/defaults.yaml lists (the H100's), so a verified H100
#                 table's configs qualify.
#   held_out, held_out_b  a grid of held-out shapes (configs/workloads/held-out.yaml), tuned on
#                 their own: the tune's JSON reports each key's regret of the runtime's choice today.
#
#   [TUNE_SECONDS=540] bash benchmarks/shipped_table.sh NAME OUT_DIR STEP...
#
# Writes to OUT_DIR: NAME-shipped-grid.trials.jsonl, the table, tune.json, <grid>.json,
# <grid>.trials.jsonl, verify-<dtype>.txt, and a log per step (stderr). On a lent machine, copy
# the journal and the table back to this checkout's results/ to resume or ship them.
set -u
name=$1; mkdir -p "$2"; out=$(realpath "$2"); shift 2
for step in "$@"; do
  case $step in tune|decode|verify-bf16|verify-fp16|learn-defaults|held_out*) ;; *) echo "unknown step: $step" >&2; exit 2 ;; esac
done
cd "$(dirname "$0")/.."
tune_seconds=${TUNE_SECONDS:-540}
slug=$(python3 -c "from dmattn_bench.hardware import device_fingerprint; print(device_fingerprint('cuda').slug())")
table=results/tables/$slug.yaml
journal=results/tune/$name-shipped-grid.trials.jsonl
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for step in "$@"; do
  start=$(date +%s)
  case $step in
    tune)
      resume=()
      if [ -f "$journal" ]; then cp "$journal" "$work/table.yaml.trials.jsonl"; resume=(--resume); fi
      timeout -s INT "$tune_seconds" python3 -m dmattn_bench tune --grid shipped --dtype bf16 --dtype fp16 \
          --out "$work/table.yaml" "${resume[@]}" --format json > "$out/tune.json" 2> "$out/tune.log"
      status=$?
      cp "$work/table.yaml.trials.jsonl" "$journal"
      cp "$journal" "$out/"
      if [ $status -eq 0 ]; then cp "$work/table.yaml" "$table"; cp "$table" "$out/"; fi ;;
    decode)
      python3 -m dmattn_bench tune --workloads configs/workloads/decode.yaml --grid shipped --merge "$table" \
          --out "$work/decode.yaml" --format json > "$out/decode-tune.json" 2> "$out/decode-tune.log"
      status=$?
      cp "$work/decode.yaml.trials.jsonl" "$out/$name-decode.trials.jsonl"
      if [ $status -eq 0 ]; then cp "$work/decode.yaml" "$table"; cp "$table" "$out/"; fi ;;
    verify-bf16|verify-fp16)
      python3 -m dmattn_bench verify --table "$table" --suite full --dtype "${step#verify-}" --restamp \
          > "$out/$step.txt" 2> "$out/$step.log"
      status=$?
      cp "$table" "$out/" ;;
    learn-defaults)
      learned_from=$(python3 -c "import yaml; d = yaml.safe_load(open('configs/defaults.yaml'))
print(' '.join([f'--journal {j}' for j in d['journals']] + [f'--validated {t}' for t in d['validated_tables']]))")
      python3 -m benchmarks learn-defaults $learned_from > "$out/learn-defaults.log" 2>&1
      status=$?
      cp configs/defaults.yaml "$out/" ;;
    held_out*)
      python3 -m dmattn_bench tune --workloads configs/workloads/held-out.yaml --grid "$step" \
          --out "$work/$step.yaml" --format json > "$out/$step.json" 2> "$out/$step.log"
      status=$?
      cp "$work/$step.yaml.trials.jsonl" "$out/$step.trials.jsonl" ;;
  esac
  echo "$step: exit $status, $(( $(date +%s) - start )) s" | tee -a "$out/steps.txt"
  [ $status -eq 0 ] || break  # a later step would use a table or defaults this one did not finish
done
