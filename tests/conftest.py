"""Shared test setup: the Triton interpreter for the CPU tier, the `gpu` marker, seeding."""

import os

# Must happen before any kernel module is imported: Triton reads TRITON_INTERPRET when the
# kernels are decorated. DMATTN_TEST_GPU=1 runs the real kernels on a GPU instead.
if os.environ.get("DMATTN_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Every adversarial case a test checks runs: no verdict from the case ledger (`tuning.ledger`),
# whose records a test's monkeypatched kernels would not invalidate; tests/test_ledger.py sets one.
os.environ["DMATTN_BENCH_LEDGER"] = ""

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Skips tests marked `gpu` when no CUDA device is present."""
    del config
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def seed():
    """Seeds torch's global generator before every test."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def installed_wheel(tmp_path_factory):
    """The project built as a wheel and installed into a folder of its own: (site folder, the
    checkout it was built from). The wheel is built from a copy of what the build reads, so no
    build output of the checkout (or of an older build) goes in."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("setuptools")
    root = Path(__file__).parents[1]
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "source"  # what the build reads: pyproject.toml, the readme, the package dirs
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(root / name, source / name)
    for package_dir in ("dmattn_bench", "kernels", "results/tables", "configs"):
        shutil.copytree(root / package_dir, source / package_dir, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source),
                    "-w", str(tmp_path / "wheel")], check=True, capture_output=True)
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    return site, root
