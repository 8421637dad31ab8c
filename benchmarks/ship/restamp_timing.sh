#!/usr/bin/env bash
# Issue 57 on a lent H200: `verify --restamp` after a kernel change that stales about a tenth of the
# shipped table's entries, against a full verify of the same table from an empty case ledger.
# Run from the repository root: bash benchmarks/ship/restamp_timing.sh OUT   (DTYPE=bf16 default)
#   1. dmattn-bench verify --table T --suite full --dtype DTYPE   (a copy of the H200 table; an
#      empty ledger, which the verify fills)
#   2. the kernel change: new text in the warp-specialized backward's main kernel, the same
#      machine code, so every entry that runs it is stale by its stamp (the 9 CUDA backward bf16
#      entries of the table's 76: checked without a GPU with dispatch.stamps.entry_status)
#   3. dmattn-bench verify --table T --suite full --dtype DTYPE --restamp   (the stale entries
#      alone; their cases whose programs the change left alone answered from the ledger)
# The kernel source is restored at the end; the table copy and ledger stay under OUT/work.
set -uo pipefail
out=$1; dtype=${DTYPE:-bf16}
source_file=kernels/cuda/flash_bwd_ws.cu
mkdir -p "$out/work"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.txt" 2>&1
cp results/tables/nvidia-h200-sm90.yaml "$out/work/table.yaml"
export DMATTN_BENCH_LEDGER=$out/work/ledger.jsonl DMATTN_BENCH_CACHE=$out/work/cache
: > "$DMATTN_BENCH_LEDGER"
start=$SECONDS
dmattn-bench verify --table "$out/work/table.yaml" --suite full --dtype "$dtype" > "$out/verify-full.txt" 2>&1
full_rc=$? full_s=$((SECONDS - start))
cp "$source_file" "$out/work/source.orig"
trap 'cp "$out/work/source.orig" "$source_file"' EXIT  # the kernel's own source again, however the run ends
sed -i '/dmattn_bwd_ws_kernel(const __grid_constant__ BwdWsParams p) {/a\  (void)sizeof(BwdWsParams);  // restamp timing probe: new text, same code' "$source_file"
stale=$(python3 -c "
from dmattn_bench.dispatch import load_table
from dmattn_bench.dispatch.stamps import entry_status
table = load_table('$out/work/table.yaml')
print(sum(entry_status(e, table.device) == 'stale' for e in table.entries), len(table.entries))" || echo "-1 -1")
start=$SECONDS
dmattn-bench verify --table "$out/work/table.yaml" --suite full --dtype "$dtype" --restamp > "$out/verify-restamp.txt" 2>&1
restamp_rc=$? restamp_s=$((SECONDS - start))
python3 - "$full_s" "$restamp_s" "$full_rc" "$restamp_rc" "$dtype" $stale <<'EOF' | tee "$out/restamp-timing.json"
import json, sys
full_s, restamp_s, full_rc, restamp_rc = map(int, sys.argv[1:5])
stale, entries = map(int, sys.argv[6:8])
print(json.dumps({"dtype": sys.argv[5], "full_verify_s": full_s, "restamp_s": restamp_s,
                  "ratio": round(restamp_s / full_s, 4) if full_s else None, "full_rc": full_rc,
                  "restamp_rc": restamp_rc, "stale_entries": stale, "entries": entries}))
EOF
