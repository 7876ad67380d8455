"""scripts/sanitize.sh's summary (CPU): compute-sanitizer reports counted against the right kernel file.

The logs below are cut from real runs: a device function of common.cuh inlined into cross_entropy's
kernel, PyTorch's own kernels, a CUDA API error without a device frame, and a report whose first
line follows pytest's progress dots.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

INITCHECK = """========= COMPUTE-SANITIZER
.....========= Uninitialized __global__ memory read of size 16 bytes
=========     at Pack128<T1> load128cs<bf16>(const T1 *)+0x440 in common.cuh:183
=========     by thread (64,0,0) in block (8,0,0)
=========     Address 0x7f2ee8000000
=========     Device Frame: Pack128<T2> load_pack<(bool)1, bf16>(const T2 *)+0x420 in cross_entropy.cu:33
=========     Device Frame: cross_entropy_forward_kernel+0x1a0 in cross_entropy.cu:120
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: cuLaunchKernel [0x1] in libcuda.so.1
=========
========= Uninitialized __global__ memory read of size 8 bytes
=========     at void at::native::reduce_kernel<(int)128, (int)4>(T3)+0x10 in Reduce.cuh:1
=========     by thread (2,24,0) in block (1,103,0)
=========
========= Program hit cudaErrorMemoryAllocation (error 2) due to "out of memory" on CUDA API call to cudaMalloc.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame: cudaMalloc [0x1] in libcudart.so.13
=========
..                                                                       [100%]
2 passed in 1.00s
========= ERROR SUMMARY: 3 errors
rc=1 seconds=12
"""

RACECHECK = """========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at softmax_forward_kernel+0x90 in softmax.cu:77
=========     and Read access at softmax_forward_kernel+0xa0 in softmax.cu:80 [4 hazards]
=========
.========= Error: Potential WAR hazard detected at __shared__ 0x2400 in block (18,0,0) :
=========     Read Thread (0,0,0) at void rmsnorm_backward_kernel<float, (int)4>(const T1 *, long long)+0x3e20 in rmsnorm.cu:359
=========     Write Thread (128,1,0) at void rmsnorm_backward_kernel<float, (int)4>(const T1 *, long long)+0x3ef0 in rmsnorm.cu:353
=========     Current Value : 0, Incoming Value : 0
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: kforge::Kernel::try_launch(kforge::DType, int) [0x10b810] in _C.cpython-312-x86_64-linux-gnu.so
=========
=========================== short test summary info ============================
SKIPPED [1] tests/test_notebook.py:13: could not import 'nbformat'
========= 1 passed, 1 skipped, 3685 deselected in 190.19s (0:03:10) ==========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
rc=1 seconds=3
"""


def test_reports_are_counted_against_their_kernel_files(tmp_path):
    logs = tmp_path / "sanitize"
    logs.mkdir()
    (logs / "initcheck-cross_entropy-dl1.log").write_text(INITCHECK)
    (logs / "racecheck-race-dl1.log").write_text(RACECHECK)
    env = dict(os.environ, OUT=str(tmp_path), SUMMARY_ONLY="1")
    r = subprocess.run(["bash", "scripts/sanitize.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr  # not clean
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["errors"]["initcheck"] == {"cross_entropy.cu": 1, "PyTorch (at::native)": 1, "host / API": 1}
    # racecheck's "Read Thread ... at <kernel>" lines are device frames; pytest's own "====" lines are
    # no reports
    assert summary["errors"]["racecheck"] == {"softmax.cu": 1, "rmsnorm.cu": 1}
    runs = {r["log"]: r for r in summary["runs"]}
    assert runs["initcheck-cross_entropy-dl1.log"]["pytest"].startswith("2 passed")
    assert runs["racecheck-race-dl1.log"]["status"] == "rc=1 seconds=3"
    assert runs["racecheck-race-dl1.log"]["pytest"].startswith("1 passed, 1 skipped")
    assert "| cross_entropy.cu | 1 | 1 |" not in (logs / "summary.md").read_text()  # columns are per tool
    assert "| softmax.cu | 0 | 1 |" in (logs / "summary.md").read_text()
    assert "host / API | 1 | 0 |" in (logs / "summary.md").read_text()


def test_summary_reports_kernel_coverage_per_tool(tmp_path):
    """Each run's coverage file (tests/conftest.py writes it) says which instantiations it launched;
    the summary unions them per tool and names the ones no run of that tool reached."""
    logs = tmp_path / "sanitize"
    logs.mkdir()
    exprs = [("gelu", "gelu_forward_kernel<float>"), ("gelu", "gelu_forward_kernel<bf16>"),
             ("rope", "rope_forward_kernel<float>")]

    def write(name, launched):
        (logs / f"{name}.log").write_text("========= ERROR SUMMARY: 0 errors\n1 passed in 1.00s\nrc=0 seconds=1\n")
        (logs / f"{name}.coverage.json").write_text(json.dumps(
            [{"program": p, "expression": e, "launched": e in launched,
              "first_test": f"tests/test_{p}.py::test_x[{e}]" if e in launched else None} for p, e in exprs]))

    write("memcheck-elementwise-dl1", {"gelu_forward_kernel<float>"})
    write("memcheck-movement-dl1", {"rope_forward_kernel<float>"})
    write("initcheck-elementwise-dl1", set())
    env = dict(os.environ, OUT=str(tmp_path), SUMMARY_ONLY="1")
    r = subprocess.run(["bash", "scripts/sanitize.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    cov = json.loads((logs / "summary.json").read_text())["coverage"]
    assert cov["memcheck"]["launched"] == 2 and cov["memcheck"]["of"] == 3
    assert cov["memcheck"]["missed"] == {"gelu": ["gelu_forward_kernel<bf16>"]}
    assert cov["initcheck"]["launched"] == 0 and set(cov["initcheck"]["missed"]) == {"gelu", "rope"}
    assert "| memcheck | 2 | 3 | gelu 1 |" in (logs / "summary.md").read_text()
    # the `cover` selection: the first test to launch each instantiation, one node id a line
    assert (logs / "cover.txt").read_text().splitlines() == [
        "tests/test_gelu.py::test_x[gelu_forward_kernel<float>]", "tests/test_rope.py::test_x[rope_forward_kernel<float>]"]


def test_nodeids_file_selects_exactly_those_tests(tmp_path):
    """SANITIZE_NODEIDS_FILE (the `cover` selection) keeps exactly the listed tests, ids with spaces
    and brackets included."""
    ids = ["tests/test_sanitize_summary.py::test_reports_are_counted_against_their_kernel_files"]
    f = tmp_path / "cover.txt"
    f.write_text("\n".join(ids) + "\n")
    env = dict(os.environ, SANITIZE_NODEIDS_FILE=str(f))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "--collect-only", "tests/test_sanitize_summary.py"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [l for l in r.stdout.splitlines() if "::" in l] == ids, r.stdout


def test_jobs_capped_by_gpu_memory(tmp_path):
    """At most one sanitizer run per 24 GiB of GPU memory (6 at once ran an 80 GB H100 out of memory):
    JOBS=8 becomes 3 on an H100, and MAX_JOBS_OK=1 keeps it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 81559\n")
    smi.chmod(0o755)
    base = dict(os.environ, OUT=str(tmp_path), PATH=f"{bin_dir}:{os.environ['PATH']}", SANITIZER="/bin/true",
                TOOLS="memcheck", SELECTIONS="runtime", DL="1", JOBS="8")
    for extra, line in (({}, "JOBS=8 -> 3: 79 GiB of GPU memory"), ({"MAX_JOBS_OK": "1"}, None)):
        r = subprocess.run(["bash", "scripts/sanitize.sh"], cwd=ROOT, env=dict(base, **extra), capture_output=True,
                           text=True, timeout=300)
        if line:
            assert line in r.stdout, r.stdout + r.stderr
        else:
            assert "JOBS=8 ->" not in r.stdout, r.stdout


def test_parts_split_a_selection_into_disjoint_shards(tmp_path):
    """PARTS=N runs a selection, `cover` and racecheck's included, as N pytest shards: together they
    hold exactly the whole selection's tests, none twice."""
    # a stand-in for compute-sanitizer that runs the command after its options
    fake = tmp_path / "sanitizer"
    fake.write_text('#!/bin/sh\nwhile [ "$1" != python3 ]; do shift; done\nexec "$@"\n')
    fake.chmod(0o755)

    def collected(selection: str, parts: int, tool: str = "none", **env_extra: str) -> dict[str, list[str]]:
        out = tmp_path / f"{tool}{selection}{parts}"
        env = dict(os.environ, OUT=str(out), TOOLS=tool, SELECTIONS=selection, DL="1", PARTS=str(parts),
                   JOBS=str(parts), PYTEST_ARGS="--collect-only", SANITIZER=str(fake), **env_extra)
        r = subprocess.run(["bash", "scripts/sanitize.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        logs = sorted((out / "sanitize").glob(f"{tool}-{selection}*-dl1.log"))
        return {p.name: [l for l in p.read_text().splitlines() if l.startswith("tests/")] for p in logs}

    def check(selection: str, whole: list[str], parts: dict[str, list[str]], tool: str = "none") -> None:
        assert list(parts) == [f"{tool}-{selection}_p{i}of3-dl1.log" for i in (1, 2, 3)], list(parts)
        ids = [i for p in parts.values() for i in p]
        assert all(parts.values()), parts
        assert len(ids) == len(set(ids)) and sorted(ids) == sorted(whole)

    whole = collected("colsum", 1)
    assert list(whole) == ["none-colsum-dl1.log"] and len(whole["none-colsum-dl1.log"]) > 10, whole
    whole = whole["none-colsum-dl1.log"]
    check("colsum", whole, collected("colsum", 3))
    cover = tmp_path / "cover.txt"
    cover.write_text("\n".join(whole[::2]) + "\n")
    check("cover", whole[::2], collected("cover", 3, COVER=str(cover)))
    # racecheck's selections (the slowest tool) split the same way
    race = {k: v for k, v in collected("race", 1, tool="racecheck").items() if "nonfinite" not in k}
    assert list(race) == ["racecheck-race-dl1.log"] and len(race["racecheck-race-dl1.log"]) > 10, race
    parts = {k: v for k, v in collected("race", 3, tool="racecheck").items() if "nonfinite" not in k}
    check("race", race["racecheck-race-dl1.log"], parts, tool="racecheck")
