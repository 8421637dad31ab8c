#!/usr/bin/env bash
# tune --backend all on the peer shapes (W1-W3 as a grid) + verify of that table, on the H200.
# Run from the repository root on the GPU machine (bash benchmarks/cuda/h200-tune-all.sh); outputs under $OUT/r.
set -u
R=$OUT/r; mkdir -p $R
export PATH=$PATH:/usr/local/cuda/bin
python3 -m pip install -q --no-deps --no-build-isolation -e . > $R/install.log 2>&1
T=$R/h200-peers-all.yaml
s=$(date +%s)
timeout 400 python3 -m dmattn_bench tune --backend all --workloads configs/workloads/peers-tune.yaml --out $T --format json > $R/tune.json 2> $R/tune.log
echo "tune rc=$? $(( $(date +%s) - s )) s" >> $R/summary.txt
s=$(date +%s)
timeout 150 python3 -m dmattn_bench verify --table $T --dtype bf16 > $R/verify.txt 2> $R/verify.err
echo "verify table rc=$? $(( $(date +%s) - s )) s" >> $R/summary.txt
python3 -m dmattn_bench show $T > $R/show.txt 2>&1
cat $R/summary.txt; tail -2 $R/tune.log; grep -v "^\s*$" $R/verify.txt | tail -8
python3 -m benchmarks cuda-compare-tables $R/tune.json $T.trials.jsonl
