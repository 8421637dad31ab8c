#!/usr/bin/env bash
# 2x H200: why the 2-GPU tune is 0.66x and not 0.5x. (1) the host's CPUs, (2) how cross-compiling
# the same candidates scales with 8/16/32 processes (cold caches), (3) the 2-GPU and 1-GPU tunes
# again, cold, with per-phase pool statistics (busy, CPU, start-up).
set -u
cd "$(dirname "$0")/.."
R=/tmp/r; rm -rf $R; mkdir -p $R
python3 -m pip install -q --no-deps --no-build-isolation -e . > $R/install.log 2>&1
{ nproc; lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|Model name|NUMA node"; free -g | head -2; cat /proc/loadavg; } > $R/host.txt
for j in 8 16 32; do
  export TRITON_CACHE_DIR=/tmp/cc-$j; rm -rf $TRITON_CACHE_DIR
  s=$(date +%s.%N)
  python3 -m dmattn_bench compile-check --arch sm90 --head-dim 128 --jobs $j --format json > $R/cc$j.json 2> $R/cc$j.log
  echo "compile-check sm90 D128 --jobs $j rc=$? wall=$(python3 -c "print(round($(date +%s.%N)-$s,1))") s" >> $R/summary.txt
done
for n in 2 1; do
  export TRITON_CACHE_DIR=/tmp/tcache-$n; rm -rf $TRITON_CACHE_DIR
  mkdir -p $R/gpus$n
  s=$(date +%s.%N)
  timeout $([ $n = 2 ] && echo 200 || echo 280) python3 -m dmattn_bench tune --dtype bf16 --dtype fp16 --gpus $n --out $R/gpus$n/nvidia-h200-sm90.yaml --format json > $R/gpus$n/tune.json 2> $R/gpus$n/tune.log
  echo "tune --gpus $n rc=$? command wall=$(python3 -c "print(round($(date +%s.%N)-$s,1))") s" >> $R/summary.txt
  python3 -c "import json; d=json.load(open('$R/gpus$n/tune.json')); print('  wall_s', d['wall_s'], 'phases', d['phases_s'], 'pools', d['phase_pools'], 'counts', d['counts'], 'entries', d['entries'])" >> $R/summary.txt 2>&1
done
tar czf $OUT/x2-profile.tgz -C /tmp r
cat $R/host.txt $R/summary.txt; grep -h "Traceback\|Error" $R/*.log $R/gpus*/tune.log | head -5
