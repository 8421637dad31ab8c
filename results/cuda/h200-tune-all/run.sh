#!/usr/bin/env bash
# tune --backend all on the peer shapes, verify the table (bf16), show it.
set -u
cd "$(dirname "$0")/.."
R=$OUT/r; mkdir -p $R
export PATH=$PATH:/usr/local/cuda/bin
python3 -m pip install -q --no-deps --no-build-isolation -e . > $R/install.log 2>&1
T=$R/h200-peers-all.yaml
s=$(date +%s)
timeout 420 python3 -m dmattn_bench tune --backend all --workloads configs/workloads/peers-tune.yaml --out $T --format json > $R/tune.json 2> $R/tune.log
echo "tune rc=$? $(( $(date +%s) - s )) s" >> $R/summary.txt
s=$(date +%s)
timeout 150 python3 -m dmattn_bench verify --table $T --dtype bf16 > $R/verify.txt 2> $R/verify.err
echo "verify rc=$? $(( $(date +%s) - s )) s" >> $R/summary.txt
python3 -m dmattn_bench show $T > $R/show.txt 2>&1
cat $R/summary.txt; grep -v "^\s*$" $R/show.txt | head -30; tail -4 $R/tune.log; grep -v "^\s*$" $R/verify.txt | head -14; tail -2 $R/verify.err
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/r/tune.json"))
print("wall", d["wall_s"], "phases", d["phases_s"], "counts", d["counts"])
for w in d["winners"]:
    k = w["key"]; e = w["evidence"]
    print(k["direction"], k["mask"], k["bias"], k["gqa_ratio"], w["backend"], w["config"], e["median_ms"], e.get("tflops"))
PY
