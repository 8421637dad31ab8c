"""The torch and triton releases the package installs are the ones it was tested on, and `info`
warns outside them (issue 54: an unbounded `torch>=2.11` pulled torch 2.14.1 and 18 CUDA
packages into a fresh venv on a CPU machine)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

from click.testing import CliRunner

from dmattn_bench import hardware
from dmattn_bench.cli.info import info

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_pyproject_installs_exactly_the_tested_releases():
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    for name, (low, high) in hardware.TESTED_RELEASES.items():
        (spec,) = [d for d in dependencies if re.match(rf"{name}\b", d)]
        assert spec == f"{name}>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}", spec


def test_untested_releases_are_named_and_tested_ones_are_not():
    assert hardware.untested_releases({"torch": "2.13.0+cpu", "triton": "3.6.0"}) == []
    assert hardware.untested_releases({"torch": "2.11.0", "triton": "3.9.1"}) == []
    lines = hardware.untested_releases({"torch": "2.14.1", "triton": "3.5.0"})
    assert lines == [
        "torch 2.14.1 is outside the releases dmattn-bench was tested on (2.11 to 2.13); install one of those if "
        "anything fails",
        "triton 3.5.0 is outside the releases dmattn-bench was tested on (3.6 to 3.9); install one of those if "
        "anything fails"]
    assert hardware.untested_releases({"torch": "nightly", "triton": "3.7.0"})[0].startswith("torch nightly")


def test_info_warns_on_an_untested_torch(monkeypatch):
    import torch

    monkeypatch.setattr(torch, "__version__", "2.14.1")
    result = CliRunner().invoke(info, ["--format", "json"])
    assert result.exit_code == 0, result.output
    assert "warning: torch 2.14.1 is outside the releases" in result.stderr
    assert json.loads(result.stdout)["untested_releases"][0].startswith("torch 2.14.1")
