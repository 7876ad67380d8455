"""`--shard I/N` (tests/conftest.py): the GPU suite split into parts that together run every test once."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import in_shard

HERE = os.path.dirname(os.path.abspath(__file__))


def _collected(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                          os.path.join(HERE, "test_gelu.py"), *args], capture_output=True, text=True,
                         cwd=os.path.dirname(HERE), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_parts_cover_every_test_once():
    every = _collected()
    parts = [_collected("--shard", f"{i}/3") for i in (1, 2, 3)]
    assert sorted(t for p in parts for t in p) == sorted(every)
    assert all(parts), [len(p) for p in parts]
    assert all(in_shard(t.split(" ")[0], i, 3) for i, p in enumerate(parts, 1) for t in p)


@pytest.mark.parametrize("spec", ["4/3", "1-3"])
def test_bad_shard_is_a_usage_error(spec):
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                          os.path.join(HERE, "test_gelu.py"), "--shard", spec], capture_output=True, text=True,
                         cwd=os.path.dirname(HERE), timeout=300)
    assert out.returncode == 4 and "--shard" in out.stderr, (out.returncode, out.stderr[-500:])
