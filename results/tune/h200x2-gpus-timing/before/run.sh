#!/usr/bin/env bash
# 2x H200: the same tune (default workloads, bf16+fp16) on 2 GPUs then on 1 GPU, each from a cold
# Triton cache, timed end to end. Results are written to $OUT as they come.
set -u
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1
echo "$(nproc) cores; $(nvidia-smi --query-gpu=name --format=csv,noheader | tr '\n' ' ')" > $OUT/summary.txt
for n in 2 1; do  # 2 GPUs first: the 1-GPU run then meets warm OS caches (imports), in its favour
  export TRITON_CACHE_DIR=/tmp/tcache-$n; rm -rf $TRITON_CACHE_DIR
  mkdir -p /tmp/g$n
  s=$(date +%s.%N)
  timeout $([ $n = 2 ] && echo 180 || echo 260) python3 -m dmattn_bench tune --dtype bf16 --dtype fp16 --gpus $n --out /tmp/g$n/nvidia-h200-sm90.yaml --format json > $OUT/gpus$n.json 2> $OUT/gpus$n.log
  echo "tune --gpus $n rc=$? command wall=$(python3 -c "print(round($(date +%s.%N)-$s,1))") s" >> $OUT/summary.txt
  python3 -c "import json; d=json.load(open('$OUT/gpus$n.json')); print('  wall_s', d['wall_s'], 'phases', d['phases_s'], 'counts', d['counts'], 'entries', d['entries'], 'speedup', round(d['geomean_speedup_vs_default'] or 0, 3))" >> $OUT/summary.txt 2>&1
done
tar czf $OUT/journals.tgz -C /tmp g1 g2
cat $OUT/summary.txt; grep -i "error\|Traceback" $OUT/gpus*.log | head -5
