#!/usr/bin/env bash
# Issue 54 on a lent H200: the short-query forward that excludes block-table entries outside the
# cache, re-validated where its code changed, as run with
#   bash benchmarks/ship/h200_page_bounds.sh OUT verify   # GPU tier, `verify --suite full --restamp` of the
#                                                          # table's stale (decode) entries, fp16 verify
#   bash benchmarks/ship/h200_page_bounds.sh OUT bench    # the decode bench (peers-decode.yaml), then again
#                                                          # on the kernel before the change
# Logs go to OUT as one archive (the device tool brings back few files).
set -uo pipefail
out=$1; step=$2
table=results/tables/nvidia-h200-sm90.yaml
logs=$out/logs; mkdir -p "$logs"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$logs/install.txt" 2>&1
if [ "$step" = verify ]; then
  start=$SECONDS
  DMATTN_TEST_GPU=1 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_cuda_kernels.py tests/test_native.py \
    -k "not test_full_suite" -n 8 > "$logs/gpu-tier.txt" 2>&1 &
  tier=$!
  dmattn-bench verify --table $table --suite full --dtype bf16 --restamp > "$logs/verify-bf16-restamp.txt" 2>&1
  echo "verify bf16 --restamp rc $? in $((SECONDS - start)) s"
  dmattn-bench verify --table $table --suite full --dtype fp16 > "$logs/verify-fp16.txt" 2>&1
  echo "verify fp16 rc $? in $((SECONDS - start)) s"
  wait $tier; echo "gpu tier rc $? ($(tail -1 "$logs/gpu-tier.txt")) in $((SECONDS - start)) s"
  cp $table "$logs/"
  dmattn-bench show $table > "$logs/show.txt" 2>&1; grep -m1 "entries" "$logs/show.txt"
else
  decode_bench() {  # NAME: the decode bench as NAME.json and NAME.md
    local start=$SECONDS
    dmattn-bench bench --workloads configs/workloads/peers-decode.yaml --format json > "$logs/$1.json" \
      2> "$logs/$1.txt"
    echo "bench $1 rc $? in $((SECONDS - start)) s"
    dmattn-bench bench --from-json "$logs/$1.json" --format markdown > "$logs/$1.md"
  }
  decode_bench h200-decode
  # the same bench on the short-query forward before the change (909e692), in the same run. The
  # table's decode entries are current on one of the two kernels only, so the other side runs the
  # decode defaults: a comparison of kernel and config together, not of the kernel alone
  for file in kernels/triton/flash_decode.py kernels/triton/decode_launch.py; do
    cp "$file" "/tmp/$(basename "$file")" && git show "909e692:$file" > "$file"
  done
  decode_bench before
  cp /tmp/flash_decode.py /tmp/decode_launch.py kernels/triton/
fi
tar czf "$out/$step.tgz" -C "$out" logs && rm -rf "$logs"
