"""The shipped tables (`results/tables/`) are current: every backend and dtype of their entries
was validated with the full adversarial suite on the kernel sources in this tree.

A kernel change (its hash: `registry.kernel_source_hash`) therefore lands together with its
re-validated tables: on each table's GPU, for each dtype it holds,
`dmattn-bench verify --table results/tables/<slug>.yaml --suite full --dtype <dtype> --restamp`
(or a re-tune followed by those verifies).
"""

from pathlib import Path

import pytest

from dmattn_bench.dispatch.lookup import validation_status
from dmattn_bench.dispatch.table import load_table

SHIPPED = sorted((Path(__file__).resolve().parents[1] / "results" / "tables").glob("*.yaml"))


def test_there_are_shipped_tables():
    assert SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_table_was_validated_on_these_kernels(path):
    table = load_table(path)
    problems = []
    for backend, per_dtype in validation_status(table).items():
        for dtype, state in per_dtype.items():
            record = table.validated.get(backend, {}).get(dtype)
            if state != "current":
                seen = "never validated" if record is None else f"validated on {record.kernel_hash} ({record.date})"
                problems.append(f"{backend} {dtype}: {state}, {seen}")
            elif record.suite != "full":
                problems.append(f"{backend} {dtype}: validated on these kernels with the {record.suite} suite only")
    fix = (f"on {table.device.name}: dmattn-bench verify --table results/tables/{path.name} --suite full "
           f"--dtype DTYPE --restamp, for each dtype above")
    assert not problems, f"{path.name}: " + "; ".join(problems) + f" ({fix})"
