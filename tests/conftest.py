"""Shared test setup: the Triton interpreter for the CPU tier, the `gpu` marker, seeding."""

import os

# Must happen before any kernel module is imported: Triton reads TRITON_INTERPRET when the
# kernels are decorated. DMATTN_TEST_GPU=1 runs the real kernels on a GPU instead.
if os.environ.get("DMATTN_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
