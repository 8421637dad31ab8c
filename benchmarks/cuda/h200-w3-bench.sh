#!/usr/bin/env bash
# bench W3 with both of our backends (their defaults), the dispatch choice and the SDPA references.
set -u
cd "$(dirname "$0")/../.."
R=$OUT/r; mkdir -p $R
export PATH=$PATH:/usr/local/cuda/bin
python3 -m pip install -q --no-deps --no-build-isolation -e . > $R/install.log 2>&1
s=$(date +%s)
timeout 400 python3 -m dmattn_bench bench --workloads configs/workloads/peers.yaml --only W3 --peers ours-triton,ours-cuda,sdpa-flash-dense,sdpa-cudnn-dense --format json > $R/bench-w3.json 2> $R/bench-w3.err
echo "bench rc=$? $(( $(date +%s) - s )) s" >> $R/summary.txt
python3 -m dmattn_bench bench --from-json $R/bench-w3.json --format markdown > $R/bench-w3.md 2>> $R/bench-w3.err
cat $R/summary.txt; cat $R/bench-w3.md; tail -3 $R/bench-w3.err
