"""Test-wide settings: one torch thread per process (two busy threads on these 2-core
machines are 2-10x slower than one), deterministic seeds."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The feature-network cache of `steadydiff eval` (eval/features.py): one fresh folder per test
# session, never the user's ~/.cache/steadydiff.
os.environ["STEADYDIFF_CACHE"] = tempfile.mkdtemp(prefix="steadydiff-test-cache-")
atexit.register(shutil.rmtree, os.environ["STEADYDIFF_CACHE"], True)

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
