#!/usr/bin/env bash
# first-use build time of the sm90 CUDA space at D=128 (empty cache, 16 jobs); tune --backend all on
# the peer shapes + verify of that table; verify --backend cuda on the defaults.
set -u
cd "$(dirname "$0")/.."
R=$OUT/r; mkdir -p $R
export PATH=$PATH:/usr/local/cuda/bin
python3 -m pip install -q --no-deps --no-build-isolation -e . > $R/install.log 2>&1
s=$(date +%s)
DMATTN_BENCH_CACHE=$(mktemp -d) timeout 200 python3 -m dmattn_bench compile-check --backend cuda --arch sm90 --head-dim 128 --jobs 16 > $R/compile-check.txt 2>&1
echo "compile-check sm90 D128 empty cache rc=$? $(( $(date +%s) - s )) s" >> $R/summary.txt
T=$R/h200-peers-all.yaml
s=$(date +%s)
timeout 400 python3 -m dmattn_bench tune --backend all --workloads configs/workloads/peers-tune.yaml --out $T --format json > $R/tune.json 2> $R/tune.log
echo "tune rc=$? $(( $(date +%s) - s )) s" >> $R/summary.txt
s=$(date +%s)
timeout 150 python3 -m dmattn_bench verify --table $T --dtype bf16 > $R/verify.txt 2> $R/verify.err
echo "verify table rc=$? $(( $(date +%s) - s )) s" >> $R/summary.txt
python3 -m dmattn_bench show $T > $R/show.txt 2>&1
cat $R/summary.txt; tail -4 $R/compile-check.txt; tail -3 $R/tune.log; grep -v "^\s*$" $R/verify.txt | tail -6
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/r/tune.json"))
print("wall", d["wall_s"], "phases", d["phases_s"], "counts", d["counts"])
for w in d["winners"]:
    k = w["key"]; e = w["evidence"]
    print(k["direction"], k["mask"], k["bias"], k["gqa_ratio"], w["backend"], w["config"], e["median_ms"], e.get("tflops"))
PY
