#!/usr/bin/env bash
# One GPU or two: the same tune (a grid of configs/workloads/default.yaml, bf16 + fp16) with
# --gpus 2, then --gpus 1, each from an empty Triton cache, timed end to end, with the per-phase
# pool statistics of the tune's JSON. Needs a host with two GPUs.
#
#   bash benchmarks/gpus_timing.sh OUT_DIR [GRID] [SECONDS_PER_RUN]
#
# Writes to OUT_DIR: gpus1.json, gpus2.json (tune --format json), summary.txt (the table below
# and whether the two tables choose the same configs as each other and as the shipped table of
# this GPU), runs.tar.gz (logs, tables, trial journals).
set -u
mkdir -p "$1"; out=$(realpath "$1"); grid=${2:-default}; limit=${3:-300}
cd "$(dirname "$0")/.."
work=$(mktemp -d)
{
  echo "host: $(nproc) cores; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | sort | uniq -c | tr -s ' ')"
  echo "code: $(git log -1 --format=%h 2>/dev/null || echo unknown); grid: $grid"
} > "$out/summary.txt"
for n in 2 1; do  # 2 GPUs first: the 1-GPU run then meets warm OS caches (imports), in its favour
  export TRITON_CACHE_DIR=$work/triton-cache-$n
  mkdir -p "$work/g$n"
  start=$(date +%s.%N)
  timeout "$limit" python3 -m dmattn_bench tune --grid "$grid" --dtype bf16 --dtype fp16 --gpus $n \
      --out "$work/g$n/table.yaml" --format json > "$out/gpus$n.json" 2> "$work/g$n/tune.log"
  echo "tune --gpus $n: exit $?, command wall $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s" >> "$out/summary.txt"
done
python3 - "$out" "$work" >> "$out/summary.txt" <<'PY'
import json, sys
from pathlib import Path

import yaml

out, work = Path(sys.argv[1]), Path(sys.argv[2])
try:
    runs = {n: json.loads((out / f"gpus{n}.json").read_text()) for n in (1, 2)}
except json.JSONDecodeError:
    sys.exit("a tune wrote no JSON (it failed or ran out of time): see its tune.log in runs.tar.gz")
rows = [("tune wall s", lambda r: r["wall_s"])]
rows += [(f"{phase} phase s", lambda r, p=phase: r["phases_s"].get(p)) for phase in runs[1]["phases_s"]]
for phase in runs[1]["phase_pools"]:
    for field in ("processes", "jobs", "cpu_s", "busy_s", "startup_s_median"):
        rows.append((f"{phase} {field}", lambda r, p=phase, f=field: r["phase_pools"].get(p, {}).get(f)))
print("| | --gpus 1 | --gpus 2 | ratio |\n|---|---|---|---|")
for name, get in rows:
    one, two = get(runs[1]), get(runs[2])
    ratio = f"{two / one:.2f}" if one and two else ""
    print(f"| {name} | {one} | {two} | {ratio} |")
print("counts:", {n: r["counts"] for n, r in runs.items()})


def configs(path):
    return {tuple(sorted(e["key"].items())): e["config"] for e in yaml.safe_load(Path(path).read_text())["entries"]}


one, two = configs(work / "g1/table.yaml"), configs(work / "g2/table.yaml")
print(f"tables: {len(one)} and {len(two)} entries, {sum(two.get(k) == v for k, v in one.items())} keys choose the same config")
from dmattn_bench.hardware import DeviceFingerprint

device = DeviceFingerprint(**yaml.safe_load((work / "g1/table.yaml").read_text())["device"])
shipped = Path("results/tables") / f"{device.slug()}.yaml"
if shipped.exists():
    ref = configs(shipped)
    for n, table in ((1, one), (2, two)):
        same = sum(table.get(k) == v for k, v in ref.items() if k in table)
        print(f"--gpus {n}: {same}/{sum(k in table for k in ref)} shared keys choose the config of {shipped}")
PY
tar -czf "$out/runs.tar.gz" -C "$work" g1 g2
cat "$out/summary.txt"
