#!/usr/bin/env bash
# Issue 55 on a lent H200: after a move of host code (nothing a kernel compiles changes), the GPU
# tier and the warm host time per call, this tree against BEFORE's in one run:
#   bash benchmarks/ship/h200_layout_check.sh OUT BEFORE_COMMIT
# `host_probe.py` runs twice, its packages first from this tree, then from BEFORE's (a worktree
# put first on PYTHONPATH, as its docstring says). Logs go to OUT as one archive.
set -uo pipefail
out=$1; before=$2
logs=$out/logs; mkdir -p "$logs"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$logs/install.txt" 2>&1
start=$SECONDS
DMATTN_TEST_GPU=1 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_cuda_kernels.py tests/test_native.py \
  -k "not test_full_suite" -n 8 > "$logs/gpu-tier.txt" 2>&1
echo "gpu tier rc $? ($(tail -1 "$logs/gpu-tier.txt")) in $((SECONDS - start)) s"
git worktree add -q /tmp/before "$before" && mkdir -p /tmp/before-packages
ln -sfn /tmp/before/dmattn_bench /tmp/before-packages/dmattn_bench
ln -sfn /tmp/before/kernels /tmp/before-packages/dmattn_kernels
(cd benchmarks && python3 host_probe.py --label after > "$logs/host-after.md" 2> "$logs/host-after.txt")
echo "host probe after rc $?"
(cd benchmarks && PYTHONPATH=/tmp/before-packages python3 host_probe.py --label before > "$logs/host-before.md" \
  2> "$logs/host-before.txt")
echo "host probe before rc $?"
tar czf "$out/layout.tgz" -C "$out" logs && rm -rf "$logs"
