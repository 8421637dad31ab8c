#!/usr/bin/env bash
# One report of every bench-*.json in DIR (`dmattn-bench bench --format json` runs, e.g. one per
# workload group or name prefix): PREFIX.json, PREFIX.md and PREFIX.png, then the markdown printed.
#   bash benchmarks/ship/bench_report.sh DIR PREFIX
set -u
dir=$1 prefix=$2
reports=()
for json in "$dir"/bench-*.json; do [ -s "$json" ] && reports+=(--from-json "$json"); done
dmattn-bench bench "${reports[@]}" --format json > "$prefix.json"
dmattn-bench bench "${reports[@]}" --format markdown > "$prefix.md"
dmattn-bench bench "${reports[@]}" --plot "$prefix.png" > /dev/null
cat "$prefix.md"
