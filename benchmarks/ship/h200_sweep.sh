#!/usr/bin/env bash
# Issue 58 on lent H200s: the sweep's shape classes tuned into the shipped table, then the sweep.
# Run from the repository root:
#   bash benchmarks/ship/h200_sweep.sh OUT tune [JOURNAL]  # configs/workloads/default.yaml's `sweep`
#       grid tuned (both backends, the ranked search, --suite full, every GPU of the host) and merged
#       into a copy of the shipped table, OUT/<table>; with JOURNAL (a journal an earlier call's
#       --budget stopped or a limit killed) the tune resumes it. Then that table's full bf16 verify (its case ledger
#       answers what the tune's suites ran). JOURNAL may be the committed
#       results/tune/h200-sweep.trials.jsonl: the resumed tune measures its out-of-memory trials again. BUDGET (default 3m, each backend's) stops starting new
#       trials; TUNE_LIMIT (default 470 s) kills the tune, whose journal a later call resumes
#       (it comes back as OUT/<table>.trials.jsonl.gz; JOURNAL may be such a .gz).
#   bash benchmarks/ship/h200_sweep.sh OUT bench "PREFIX;PREFIX;..."  # the sweep bench on the
#       working tree's table, one `bench --only PREFIX` run per workload-name prefix (e.g.
#       "sweep-dims D96;sweep-issue;sweep-kinds D128 causal"), each JSON kept in OUT/bench.tgz as it
#       ends (a call cut short by its time limit keeps what ran), then OUT/h200-sweep.{md,json,png}
#       of every run; bench-N.json files an earlier call left, put in IN=DIR, join the report.
#       Flex on every row, SDPA's flash and cuDNN kernels on the rows without mask and bias
#       (WORKLOADS=FILE benches another workloads file). GPUS=N spreads the prefixes over the
#       host's first N GPUs, one bench at a time on each.
#   bash benchmarks/ship/h200_sweep.sh OUT swizzled  # the GPU tier's warp-specialized forward
#       and backward suites in bf16 (D80 and D96 among their head dims) on GPU 1 while the
#       `sweep-swizzled` grid's keys (D80, D96) are tuned again on GPU 0, both backends (a merged
#       tune's entries replace the table's: Triton's candidates compete again; BUDGET, default 2m,
#       each backend's), into OUT/<table>; then the sweep bench of those rows on that table
#       (OUT/h200-sweep-d96.*).
#   bash benchmarks/ship/h200_sweep.sh OUT d192  # the GPU tier's transposed-backward suites (D160,
#       D192; bf16 and fp16), then the `sweep-d192` grid's backward tuned again, both backends, every
#       candidate (--exhaustive: the transposed configs have no journal to rank them by; BUDGET,
#       default 4m, each backend's), into OUT/<table>; then that table's D192 backward entries
#       verified with the full suite in bf16 and fp16 (OUT/verify-d192-{bf16,fp16}.txt).
#   bash benchmarks/ship/h200_sweep.sh OUT verify  # the working tree's table verified in bf16 with
#       the full suite, its CUDA entries on GPU 0 and the rest (Triton, decode) on GPU 1 at once:
#       OUT/verify-{cuda,triton}-bf16.txt (VERIFY_LIMIT, default 540 s, each).
#   bash benchmarks/ship/h200_sweep.sh OUT tier  # the README's GPU tier, tests/test_gpu.py on GPU 0
#       and the other GPU test files on GPU 1: OUT/gpu-tier-{0,1}.txt (TIER_LIMIT, default 540 s).
# Logs go to OUT/logs.tgz (the device tool brings back few files).
set -uo pipefail
out=$1; step=$2
name=nvidia-h200-sm90.yaml
work=$(mktemp -d)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$work/install.txt" 2>&1
if [ "$step" = tune ]; then
  resume=()
  if [ -n "${3:-}" ]; then
    case $3 in *.gz) gzip -dc "$3" > "$out/$name.trials.jsonl" ;; *) cp "$3" "$out/$name.trials.jsonl" ;; esac
    resume=(--resume)
  fi
  start=$SECONDS
  timeout "${TUNE_LIMIT:-470}" dmattn-bench tune --workloads configs/workloads/default.yaml --grid sweep --backend all \
    --space configs/space/cuda-fwd-ws.yaml --space configs/space/cuda-bwd.yaml \
    --space configs/space/triton-fwd.yaml --space configs/space/triton-bwd.yaml \
    --suite full --gpus all --budget "${BUDGET:-3m}" --trial-timeout 60 "${resume[@]}" \
    --merge "results/tables/$name" --out "$out/$name" --format json > "$out/sweep-tune.json" 2> "$work/sweep-tune.txt"
  echo "tune rc $? in $((SECONDS - start)) s"
  tail -5 "$work/sweep-tune.txt"
  # the journal (18 MB after three runs) comes back only compressed: the next call resumes it
  gzip -c "$out/$name.trials.jsonl" > "$out/$name.trials.jsonl.gz" && rm "$out/$name.trials.jsonl"
  start=$SECONDS
  [ -s "$out/$name" ] && timeout "${VERIFY_LIMIT:-100}" dmattn-bench verify --table "$out/$name" --dtype bf16 --suite full \
    > "$out/verify-bf16.txt" 2> "$work/verify-bf16.log"
  echo "verify bf16 rc $? in $((SECONDS - start)) s: $(tail -1 "$work/verify-bf16.log")"
  dmattn-bench show "$out/$name" 2>&1 | tail -3
elif [ "$step" = swizzled ]; then
  (CUDA_VISIBLE_DEVICES=1 DMATTN_TEST_GPU=1 timeout "${TIER_LIMIT:-360}" python3 -m pytest -q -m gpu tests/test_gpu.py \
    -k "(warp_specialized_forward_passes or warp_specialized_backward_passes) and bf16" -n 8 -p no:cacheprovider \
    > "$out/gpu-tier.txt" 2>&1
   echo "GPU tier rc $?: $(tail -1 "$out/gpu-tier.txt")") &
  start=$SECONDS
  CUDA_VISIBLE_DEVICES=0 timeout "${TUNE_LIMIT:-360}" dmattn-bench tune --workloads configs/workloads/default.yaml \
    --grid sweep-swizzled --backend all --space configs/space/cuda-fwd-ws.yaml --space configs/space/cuda-bwd.yaml \
    --space configs/space/triton-fwd.yaml --space configs/space/triton-bwd.yaml --gpus 1 --budget "${BUDGET:-2m}" \
    --suite full --merge "results/tables/$name" --out "$out/$name" --format json > "$out/swizzled-tune.json" \
    2> "$work/swizzled-tune.txt"
  echo "tune rc $? in $((SECONDS - start)) s"; tail -4 "$work/swizzled-tune.txt"
  [ -f "$out/$name.trials.jsonl" ] && gzip -f "$out/$name.trials.jsonl"
  wait
  if [ -s "$out/$name" ]; then
    timeout "${BENCH_LIMIT:-200}" dmattn-bench bench --table "$out/$name" --workloads configs/workloads/sweep.yaml \
      --only "sweep-dims D80" --only "sweep-dims D96" --only sweep-issue --peers flex,sdpa-flash-dense \
      --format json > "$work/bench-1.json" 2> "$work/bench.txt"
    echo "bench rc $?"
    bash benchmarks/ship/bench_report.sh "$work" "$out/h200-sweep-d96" | grep -A6 "^Against each peer"
  fi
elif [ "$step" = d192 ]; then
  start=$SECONDS
  DMATTN_TEST_GPU=1 timeout "${TIER_LIMIT:-240}" python3 -m pytest -q -m gpu tests/test_gpu.py -k transposed_backward \
    -n 8 -p no:cacheprovider > "$out/gpu-tier-transposed.txt" 2>&1
  echo "GPU tier rc $? in $((SECONDS - start)) s: $(tail -1 "$out/gpu-tier-transposed.txt")"
  start=$SECONDS
  timeout "${TUNE_LIMIT:-300}" dmattn-bench tune --workloads configs/workloads/default.yaml --grid sweep-d192 \
    --backend all --space configs/space/cuda-bwd.yaml --space configs/space/triton-bwd.yaml --exhaustive \
    --budget "${BUDGET:-4m}" --suite full --merge "results/tables/$name" --out "$out/$name" --format json \
    > "$out/d192-tune.json" 2> "$work/d192-tune.txt"
  echo "tune rc $? in $((SECONDS - start)) s"; tail -4 "$work/d192-tune.txt"
  [ -f "$out/$name.trials.jsonl" ] && gzip -f "$out/$name.trials.jsonl"
  if [ -s "$out/$name" ]; then
    # a table of its D192 backward entries alone
    python3 -c 'import sys, yaml; t = yaml.safe_load(open(sys.argv[1])); t["entries"] = [e for e in t["entries"]
if e["key"]["head_dim"] == 192 and e["key"]["direction"] == "bwd"]; yaml.safe_dump(t, open(sys.argv[2], "w"),
sort_keys=False); print(len(t["entries"]), "D192 backward entries")' "$out/$name" "$work/d192.yaml"
    for dtype in bf16 fp16; do
      start=$SECONDS
      timeout "${VERIFY_LIMIT:-100}" dmattn-bench verify --table "$work/d192.yaml" --dtype $dtype --suite full \
        > "$out/verify-d192-$dtype.txt" 2> "$work/verify-$dtype.log"
      echo "verify $dtype rc $? in $((SECONDS - start)) s: $(tail -1 "$work/verify-$dtype.log")"
    done
  fi
elif [ "$step" = verify ]; then
  for part in cuda:0 triton:1; do
    backend=${part%:*}; gpu=${part#*:}
    (start=$SECONDS
     CUDA_VISIBLE_DEVICES=$gpu timeout "${VERIFY_LIMIT:-540}" dmattn-bench verify --table "results/tables/$name" \
       --backend "$backend" --suite full --dtype bf16 > "$out/verify-$backend-bf16.txt" 2> "$work/verify-$backend.log"
     echo "verify $backend bf16 rc $? in $((SECONDS - start)) s: $(tail -1 "$work/verify-$backend.log")") &
  done
  wait
elif [ "$step" = tier ]; then
  start=$SECONDS
  (CUDA_VISIBLE_DEVICES=0 DMATTN_TEST_GPU=1 timeout "${TIER_LIMIT:-540}" python3 -m pytest -q -m gpu tests/test_gpu.py \
     -k "not test_full_suite" -n 8 -p no:cacheprovider > "$out/gpu-tier-0.txt" 2>&1
   echo "GPU tier (test_gpu.py) rc $? in $((SECONDS - start)) s: $(tail -1 "$out/gpu-tier-0.txt")") &
  (CUDA_VISIBLE_DEVICES=1 DMATTN_TEST_GPU=1 timeout "${TIER_LIMIT:-540}" python3 -m pytest -q -m gpu \
     tests/test_gpu_varlen.py tests/test_cuda_kernels.py tests/test_native.py -k "not test_full_suite" -n 8 \
     -p no:cacheprovider > "$out/gpu-tier-1.txt" 2>&1
   echo "GPU tier (the other files) rc $? in $((SECONDS - start)) s: $(tail -1 "$out/gpu-tier-1.txt")") &
  wait
else
  runs=$work/runs; mkdir -p "$runs"
  [ -n "${IN:-}" ] && cp "$IN"/bench-*.json "$runs"/ 2>/dev/null
  # runs of an earlier call (IN) keep their numbers: a call cut short on several GPUs leaves gaps
  first=$(ls "$runs" | sed -n 's/^bench-\([0-9]*\)\.json$/\1/p' | sort -n | tail -1); first=${first:-0}
  IFS=';' read -ra prefixes <<< "$3"
  gpus=${GPUS:-1}
  # prefix i runs on GPU i % GPUS, each GPU's in turn: the GPUs of a host share nothing a bench
  # times (an eager call's host work runs on its own core of 32)
  for ((gpu = 0; gpu < gpus; gpu++)); do
    (
      for ((i = gpu; i < ${#prefixes[@]}; i += gpus)); do
        index=$((first + i + 1)); start=$SECONDS
        CUDA_VISIBLE_DEVICES=$gpu dmattn-bench bench --workloads "${WORKLOADS:-configs/workloads/sweep.yaml}" \
          --only "${prefixes[$i]}" --peers flex,sdpa-flash-dense,sdpa-cudnn-dense --format json \
          > "$runs/.bench-$index.part" 2> "$work/bench-$index.txt"
        echo "bench '${prefixes[$i]}' on GPU $gpu rc $? in $((SECONDS - start)) s"
        mv "$runs/.bench-$index.part" "$runs/bench-$index.json"
        # a finished run reaches OUT at once (a call cut short by its time limit keeps it)
        tar -C "$runs" -czf "$out/bench-gpu$gpu.tmp" --exclude='.*.part' . && mv "$out/bench-gpu$gpu.tmp" "$out/bench.tgz"
      done
    ) &
  done
  wait
  tar -C "$runs" -czf "$out/bench.tmp" --exclude='.*.part' . && mv "$out/bench.tmp" "$out/bench.tgz"  # every run, whichever GPU's tar came last
  bash benchmarks/ship/bench_report.sh "$runs" "$out/h200-sweep" | grep -A12 "^Against each peer"
fi
tar -C "$work" -czf "$out/logs.tgz" .
