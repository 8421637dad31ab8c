#!/usr/bin/env bash
# Issue 57 on a lent GPU: the default (ranked) tune against --exhaustive on the same grid, back to
# back on this host, both dtypes, both backends; then the wall ratio and each key's regret by the
# exhaustive run's timings (`python -m benchmarks ranked-vs-exhaustive`).
# Run from the repository root: bash benchmarks/ship/ranked_tune.sh OUT [WORKLOADS.yaml]
# (default configs/workloads/default.yaml; configs/workloads/held-out.yaml for the held-out check).
#   SEARCHES="ranked exhaustive ranked-warm" (the default) picks the runs, in order:
#     ranked, exhaustive: each with cold compile caches (Triton's kernels, the CUDA cubins, the
#       native path) and a case ledger of its own, empty at the start;
#     ranked-warm: a ranked run with cold compile caches and a copy of the ledger the exhaustive
#       run left (OUT/NAME-exhaustive.ledger.jsonl): a re-tune on the same kernels, whose winners'
#       cases that code already passed are not run again.
#   The exhaustive run may come from an earlier call: put its OUT files back in OUT first.
#   DTYPES="bf16" and BACKEND=triton narrow the grid (default: both dtypes, both backends;
#   DTYPES="" keeps each workload's own dtype, as held-out.yaml picks them). GRID picks the
#   workloads file's grid (default: default; held-out.yaml has held_out and held_out_b).
set -uo pipefail
out=$1; workloads=${2:-configs/workloads/default.yaml}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.txt" 2>&1
name=$(basename "$workloads" .yaml)
dtype_flags=(); for dtype in ${DTYPES-bf16 fp16}; do dtype_flags+=(--dtype "$dtype"); done
for search in ${SEARCHES:-ranked exhaustive ranked-warm}; do
  flag=$([ "$search" = exhaustive ] && echo --exhaustive || true)
  ledger=$out/$name-$search.ledger.jsonl
  if [ "$search" = ranked-warm ]; then cp "$out/$name-exhaustive.ledger.jsonl" "$ledger" || continue; else : > "$ledger"; fi
  cache=$(mktemp -d)
  start=$SECONDS
  TRITON_CACHE_DIR=$cache/triton DMATTN_BENCH_CACHE=$cache/dmattn DMATTN_BENCH_LEDGER=$ledger \
    dmattn-bench tune --workloads "$workloads" --grid "${GRID:-default}" "${dtype_flags[@]}" --backend "${BACKEND:-all}" $flag \
    --out "$out/$name-$search.yaml" --format json > "$out/$name-$search.json" 2> "$out/$name-$search.txt"
  echo "$search tune rc $? in $((SECONDS - start)) s"
  rm -rf "$cache"
done
for search in ranked ranked-warm; do
  [ -s "$out/$name-$search.json" ] && [ -s "$out/$name-exhaustive.json" ] || continue
  compare=(python3 -m benchmarks ranked-vs-exhaustive "$out/$name-$search.json" "$out/$name-exhaustive.json"
           --journal "$out/$name-exhaustive.yaml.trials.jsonl")
  "${compare[@]}" --format json > "$out/$name-$search-vs-exhaustive.json"
  "${compare[@]}" | tee "$out/$name-$search-vs-exhaustive.md" | head -3
done
