"""`--shard I/N` (tests/conftest.py): the GPU suite split into parts that together run every test once."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import in_shard, longest_first, recorded_durations

HERE = os.path.dirname(os.path.abspath(__file__))


def _collected(*args: str, env: dict | None = None) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                          os.path.join(HERE, "test_gelu.py"), *args], capture_output=True, text=True,
                         cwd=os.path.dirname(HERE), timeout=300, env=env)
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


# ---- durations: recorded per test, and the suite ordered longest first ----------------------------
def test_durations_are_recorded_once_per_test(tmp_path):
    """TEST_DURATIONS_FILE gets one line per test, from the controller only under pytest-xdist."""
    for workers in ([], ["-n", "2"]):
        path = tmp_path / f"durations{len(workers)}.txt"
        env = dict(os.environ, TEST_DURATIONS_FILE=str(path), TEST_ORDER_BY_DURATION="0")
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                              os.path.join(HERE, "test_gelu.py"), "-k", "dispatch or checker", *workers],
                             capture_output=True, text=True, cwd=os.path.dirname(HERE), timeout=600, env=env)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        lines = path.read_text().splitlines()
        ran = int(out.stdout.split(" passed")[0].split()[-1]) if " passed" in out.stdout else 0
        assert lines and len(lines) == len({line.split("\t")[1] for line in lines}), "a test recorded twice"
        assert len(lines) >= ran > 0, (len(lines), ran)
        assert all(float(line.split("\t")[0]) >= 0 for line in lines)
        assert set(recorded_durations(str(path))) == {line.split("\t")[1] for line in lines}


def test_longest_first_keeps_ties_and_counts_the_unlisted_as_the_mean():
    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    items = [Item(n) for n in "abcde"]
    order = [it.nodeid for it in longest_first(items, {"a": 1.0, "b": 5.0, "d": 1.0, "e": 3.0})]
    assert order == ["b", "e", "c", "a", "d"]  # c, unlisted, counts as the mean 2.5; a before d (ties)
    assert [it.nodeid for it in longest_first(items, {})] == list("abcde")


def test_suite_runs_longest_first_and_parts_still_cover_every_test_once(tmp_path):
    """With a durations file the collection puts its slowest tests first; the --shard parts still
    partition the suite (every process computes the same order)."""
    plain = _collected(env=dict(os.environ, TEST_ORDER_BY_DURATION="0"))
    slow, second = plain[-1].split(" ")[0], plain[len(plain) // 2].split(" ")[0]
    path = tmp_path / "durations.txt"
    path.write_text(f"100.0\t{slow}\nnot a number\t{plain[0]}\n50.5\t{second}\n0.001\t{plain[1]}\n")
    env = dict(os.environ, TEST_ORDER_DURATIONS=str(path))
    ordered = _collected(env=env)
    assert ordered[:2] == [slow, second] and sorted(ordered) == sorted(plain)
    parts = [_collected("--shard", f"{i}/2", env=env) for i in (1, 2)]
    assert sorted(t for p in parts for t in p) == sorted(plain)
