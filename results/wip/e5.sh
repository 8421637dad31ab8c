#!/usr/bin/env bash
# re-tune the shipped H200 table + verify full bf16/fp16 + GPU tier
set -u
cd "$(dirname "$0")/.."
R=$OUT/r; mkdir -p $R
export PATH=$PATH:/usr/local/cuda/bin
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1
T=$R/nvidia-h200-sm90.yaml
s=$(date +%s)
timeout 280 python3 -m dmattn_bench tune --dtype bf16 --dtype fp16 --out $T --format json > /tmp/tune.json 2> $R/tune.log
echo "tune rc=$? $(( $(date +%s) - s )) s" >> $R/summary.txt
for d in bf16 fp16; do
  s=$(date +%s)
  timeout 100 python3 -m dmattn_bench verify --table $T --dtype $d --suite full > $R/verify-$d.txt 2> /tmp/verify-$d.err
  echo "verify $d rc=$? $(( $(date +%s) - s )) s" >> $R/summary.txt
done
cat $R/summary.txt; tail -3 $R/tune.log; for d in bf16 fp16; do grep -v "^\s*$" $R/verify-$d.txt | tail -3; done
