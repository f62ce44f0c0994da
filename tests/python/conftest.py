import os
import subprocess

import numpy as np
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device and a CUDA build (label gpu in CTest)")


@pytest.fixture
def cli():
    """Runs the `dmattn` command-line tool (the same build) and fails on a non-zero exit."""
    exe = os.environ.get("DMATTN_CLI")
    if not exe:
        pytest.skip("DMATTN_CLI is not set (CTest sets it to the built tool)")

    def run(*args):
        r = subprocess.run([exe, *map(str, args)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return r
    return run


def llm_like(rng, shape, dtype=np.float32):
    """Normal data with a few large channels, like real queries and keys."""
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., :: max(1, shape[-1] // 8)] *= 6.0
    return x.astype(dtype)
