#!/usr/bin/env bash
# Issue 55 on a lent H200: after a move of host code (nothing a kernel compiles changes), the GPU
# tier and the warm host time per call, this tree against an earlier one in the same run:
#   mkdir before && git archive BEFORE_COMMIT dmattn_bench kernels results/tables configs | tar x -C before
#   bash benchmarks/ship/h200_layout_check.sh OUT before     # (the folder travels untracked; delete it after)
# `host_probe.py` runs twice each way, alternating, its packages from this tree, then from the
# earlier one put first on PYTHONPATH (as its docstring says). Logs go to OUT as one archive.
set -uo pipefail
out=$1; before=$(realpath "$2")
logs=$out/logs; mkdir -p "$logs"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$logs/install.txt" 2>&1
start=$SECONDS
DMATTN_TEST_GPU=1 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_cuda_kernels.py tests/test_native.py \
  -k "not test_full_suite" -n 8 > "$logs/gpu-tier.txt" 2>&1
echo "gpu tier rc $? ($(tail -1 "$logs/gpu-tier.txt")) in $((SECONDS - start)) s"
mkdir -p /tmp/before-packages
ln -sfn "$before/dmattn_bench" /tmp/before-packages/dmattn_bench
ln -sfn "$before/kernels" /tmp/before-packages/dmattn_kernels
for round in 1 2; do
  (cd benchmarks && python3 host_probe.py --label "after $round" > "$logs/host-after-$round.md" 2>/dev/null)
  (cd benchmarks && PYTHONPATH=/tmp/before-packages python3 host_probe.py --label "before $round" \
    > "$logs/host-before-$round.md" 2>/dev/null)
done
tar czf "$out/layout.tgz" -C "$out" logs && rm -rf "$logs"
