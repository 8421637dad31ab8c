#!/usr/bin/env bash
# Issue 56 on a lent H200: packed sequences and the sliding window. Run from the repository root:
#   bash benchmarks/ship/h200_varlen.sh OUT tier     # the GPU tier (with the packed / window tests), then
#                                                    # `verify --restamp` of the table's entries the kernel
#                                                    # change left stale, bf16 and fp16 (the table lands in OUT)
#   bash benchmarks/ship/h200_varlen.sh OUT tune     # tunes configs/workloads/varlen.yaml into the table,
#                                                    # restamps the new entries (bf16, fp16), benches packed.yaml
# Logs go to OUT as one archive.
set -uo pipefail
out=$1; step=$2
table=results/tables/nvidia-h200-sm90.yaml
logs=$out/logs; mkdir -p "$logs"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$logs/install.txt" 2>&1
restamp() {
  for dtype in bf16 fp16; do
    start=$SECONDS
    dmattn-bench verify --table $table --suite full --dtype $dtype --restamp > "$logs/restamp-$dtype.txt" 2>&1
    echo "restamp $dtype rc $? in $((SECONDS - start)) s: $(grep -E 'of its|worst|cases' "$logs/restamp-$dtype.txt" | tail -2 | tr '\n' ' ')"
  done
}
if [ "$step" = tier ]; then
  start=$SECONDS
  DMATTN_TEST_GPU=1 timeout 330 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_gpu_varlen.py \
    tests/test_cuda_kernels.py tests/test_native.py -k "not test_full_suite" -n 8 > "$logs/gpu-tier.txt" 2>&1
  echo "gpu tier rc $? ($(tail -1 "$logs/gpu-tier.txt")) in $((SECONDS - start)) s"
  restamp
else
  start=$SECONDS
  dmattn-bench tune --workloads configs/workloads/varlen.yaml --table $table > "$logs/tune.txt" 2>&1
  echo "tune rc $? in $((SECONDS - start)) s"
  restamp
  start=$SECONDS
  dmattn-bench bench --workloads configs/workloads/packed.yaml --format json > "$logs/h200-packed.json" \
    2> "$logs/bench-packed.txt"
  echo "packed bench rc $? in $((SECONDS - start)) s"
  dmattn-bench bench --from-json "$logs/h200-packed.json" --format markdown > "$logs/h200-packed.md"
fi
cp $table "$out/"
tar czf "$out/$step.tgz" -C "$out" logs && rm -rf "$logs"
