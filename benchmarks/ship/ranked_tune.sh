#!/usr/bin/env bash
# Issue 57 on a lent GPU: the default (ranked) tune against --exhaustive on the same grid, back to
# back on this host, each with cold compile caches, both dtypes, both backends; then the wall ratio
# and each key's regret by the exhaustive run's timings (`python -m benchmarks ranked-vs-exhaustive`).
# Run from the repository root: bash benchmarks/ship/ranked_tune.sh OUT [WORKLOADS.yaml]
# (default configs/workloads/default.yaml; configs/workloads/held-out.yaml for the held-out check).
# DTYPES="bf16" and BACKEND=triton narrow the grid (default: both dtypes, both backends).
set -uo pipefail
out=$1; workloads=${2:-configs/workloads/default.yaml}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.txt" 2>&1
name=$(basename "$workloads" .yaml)
dtype_flags=(); for dtype in ${DTYPES:-bf16 fp16}; do dtype_flags+=(--dtype "$dtype"); done
for search in ranked exhaustive; do
  flag=$([ "$search" = exhaustive ] && echo --exhaustive || true)
  cache=$(mktemp -d)  # cold: nothing compiled before (Triton's kernels, the CUDA cubins, the native path)
  start=$SECONDS
  TRITON_CACHE_DIR=$cache/triton DMATTN_BENCH_CACHE=$cache/dmattn dmattn-bench tune --workloads "$workloads" "${dtype_flags[@]}" --backend "${BACKEND:-all}" $flag \
    --out "$out/$name-$search.yaml" --format json > "$out/$name-$search.json" 2> "$out/$name-$search.txt"
  echo "$search tune rc $? in $((SECONDS - start)) s"
  rm -rf "$cache"
done
python3 -m benchmarks ranked-vs-exhaustive "$out/$name-ranked.json" "$out/$name-exhaustive.json" --format json \
  > "$out/$name-ranked-vs-exhaustive.json"
python3 -m benchmarks ranked-vs-exhaustive "$out/$name-ranked.json" "$out/$name-exhaustive.json" \
  | tee "$out/$name-ranked-vs-exhaustive.md" | head -3
