#!/usr/bin/env bash
# 2x H200: the same tune (default workloads, bf16+fp16) on 2 GPUs then on 1 GPU, each from a cold
# Triton cache, timed end to end, with per-phase pool statistics. Results are written to $OUT.
set -u
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1
echo "$(nproc) cores; $(nvidia-smi --query-gpu=name --format=csv,noheader | tr '\n' ' '); $(git log -1 --format=%h 2>/dev/null)" > $OUT/summary.txt
for n in 2 1; do  # 2 GPUs first: the 1-GPU run then meets warm OS caches (imports), in its favour
  export TRITON_CACHE_DIR=/tmp/tcache-$n; rm -rf $TRITON_CACHE_DIR
  mkdir -p /tmp/g$n
  s=$(date +%s.%N)
  timeout $([ $n = 2 ] && echo 180 || echo 260) python3 -m dmattn_bench tune --dtype bf16 --dtype fp16 --gpus $n --out /tmp/g$n/nvidia-h200-sm90.yaml --format json > $OUT/gpus$n.json 2> $OUT/gpus$n.log
  echo "tune --gpus $n rc=$? command wall=$(python3 -c "print(round($(date +%s.%N)-$s,1))") s" >> $OUT/summary.txt
  python3 -c "import json; d=json.load(open('$OUT/gpus$n.json')); print('  wall_s', d['wall_s'], 'phases', d['phases_s'], 'counts', d['counts'], 'entries', d['entries'], 'speedup', round(d['geomean_speedup_vs_default'] or 0, 3)); print('  pools', d['phase_pools'])" >> $OUT/summary.txt 2>&1
  cp /tmp/g$n/nvidia-h200-sm90.yaml $OUT/gpus$n-table.yaml; cp /tmp/g$n/nvidia-h200-sm90.yaml.trials.jsonl $OUT/gpus$n.trials.jsonl
done
python3 - >> $OUT/summary.txt <<'PY'
import yaml
def configs(path):
    return {tuple(sorted(e["key"].items())): e["config"] for e in yaml.safe_load(open(path))["entries"]}
shipped = configs("results/tables/nvidia-h200-sm90.yaml")
for n in (1, 2):
    new = configs(f"/tmp/g{n}/nvidia-h200-sm90.yaml")
    print(f"gpus{n}: {sum(new.get(k) == v for k, v in shipped.items())}/{len(shipped)} keys choose the shipped table's config")
PY
cat $OUT/summary.txt; grep -i "error\|Traceback" $OUT/gpus*.log | head -5
