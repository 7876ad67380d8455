"""Runtime faults (CPU: NVRTC compiles without a GPU): a disk cache that cannot be written (read-only,
not creatable, full, a write failing part-way), a kernel source or header edited between runs, two
processes and two threads compiling the same and different kernels at once, and bad arguments at
kforge.jit / kforge.compile.

Every subprocess gets its own KFORGE_CACHE_DIR. The read-only and full file systems are real ones: a
tmpfs mounted (read-only, or small and filled up) in a private mount namespace (`unshare -rm`), so the
runtime sees EROFS / ENOSPC from the kernel, also when the tests run as root (which ignores file
modes); where unshare is not allowed those tests skip with the reason.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kforge

ROOT = Path(__file__).resolve().parents[1]
# Small kernels: a few hundred ms of NVRTC each on a CPU.
K1, K2, K3 = "axpy", "residual", "swiglu"


def _python(code: str, cache: Path | str, env_extra: dict | None = None) -> list[str]:
    env = dict(os.environ, KFORGE_CACHE_DIR=str(cache), PYTHONWARNINGS="default")
    env.update(env_extra or {})
    return [sys.executable, "-c", textwrap.dedent(code)], env


def run_py(code: str, cache: Path | str, env_extra: dict | None = None, wrap: list[str] | None = None,
           timeout: int = 600) -> dict:
    """Run `code` in a fresh interpreter (inside `wrap`, e.g. unshare, if given); it prints one JSON
    line last, returned with the process's stderr."""
    argv, env = _python(code, cache, env_extra)
    r = subprocess.run((wrap or []) + argv, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"subprocess failed:\n{r.stdout}\n{r.stderr}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["stderr"] = r.stderr
    return out


# Compiles K1 and K2, recording the KforgeCacheWarnings; then lists what the cache directory holds.
COMPILE_TWO = f"""
import json, os, warnings, kforge
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    lowered = [kforge._C.compile(n, 90) for n in ({K1!r}, {K2!r})]
info = kforge.cache_info()
info.pop("entries")
info["lowered"] = lowered
info["warnings"] = [str(x.message) for x in w if issubclass(x.category, kforge.KforgeCacheWarning)]
cache = kforge.cache_dir()
info["files"] = sorted(os.listdir(cache)) if os.path.isdir(cache) else None
print(json.dumps(info))
"""


def assert_ran_without_disk_cache(out: dict, why: str) -> None:
    """Both kernels compiled; one warning naming the directory and the cause; no file left behind."""
    assert all(out["lowered"]) and out["nvrtc_compiles"] == 2, out
    assert len(out["warnings"]) == 1, out["warnings"]
    msg = out["warnings"][0]
    assert "cannot write the kernel cache in" in msg and why in msg and "running without the disk cache" in msg, msg
    assert out["disk_write_failures"] == 1  # the second kernel does not try again
    assert not [f for f in (out["files"] or []) if ".tmp." in f or f.endswith(".cubin")], out["files"]


def _unshare_works() -> bool:
    import tempfile

    if shutil.which("unshare") is None:
        return False
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run(["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", d],
                           capture_output=True, timeout=30)
    return r.returncode == 0


needs_mount_ns = pytest.mark.skipif(not _unshare_works(), reason="needs `unshare -rm` (a private mount "
                                    "namespace) to mount a read-only / full tmpfs")


def in_mount_ns(setup: str) -> list[str]:
    """argv prefix: run the command in a private mount namespace after the shell commands `setup`
    (which mount there; the mounts vanish with the namespace)."""
    return ["unshare", "-rm", "sh", "-c", f"{setup} && exec \"$@\"", "sh"]


# ---- the disk cache cannot be written ------------------------------------------------------------------
@needs_mount_ns
def test_read_only_cache_dir(tmp_path):
    cache = tmp_path / "ro"
    cache.mkdir()
    wrap = in_mount_ns(f"mount -t tmpfs -o ro,size=1m tmpfs {cache}")
    out = run_py(COMPILE_TWO, cache, wrap=wrap)
    assert_ran_without_disk_cache(out, "Read-only file system")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a directory whatever its mode (the "
                                              "read-only file system test covers root)")
def test_cache_dir_without_write_permission(tmp_path):
    cache = tmp_path / "locked"
    cache.mkdir()
    cache.chmod(0o555)
    try:
        out = run_py(COMPILE_TWO, cache)
    finally:
        cache.chmod(0o755)
    assert_ran_without_disk_cache(out, "Permission denied")


def test_cache_dir_not_creatable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = run_py(COMPILE_TWO, blocker / "cache")
    assert_ran_without_disk_cache(out, "Not a directory")
    assert out["files"] is None and blocker.read_text() == "not a directory"


@needs_mount_ns
def test_full_cache_disk(tmp_path):
    """ENOSPC from a real file system: a 64 KiB tmpfs filled to the last byte before kforge writes."""
    cache = tmp_path / "full"
    cache.mkdir()
    fill = f"mount -t tmpfs -o size=64k tmpfs {cache} && (dd if=/dev/zero of={cache}/filler bs=4k 2>/dev/null; true)"
    out = run_py(COMPILE_TWO, cache, wrap=in_mount_ns(fill))
    out["files"].remove("filler")
    assert_ran_without_disk_cache(out, "No space left on device")


def test_write_failing_part_way_leaves_no_temp_file(tmp_path):
    """A write that fails after some bytes went out (RLIMIT_FSIZE: the kernel cuts the file at 2 KiB and
    returns EFBIG): the temporary file is removed, nothing is renamed into place, one warning."""
    code = "import resource, signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n" \
           "import kforge\nresource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.RLIM_INFINITY))\n" + COMPILE_TWO
    out = run_py(code, tmp_path / "cache")
    assert_ran_without_disk_cache(out, "File too large")
    assert out["files"] == []  # the directory was made, the file never completed


def test_a_writable_cache_dir_works_again_after_a_failure(tmp_path, recwarn):
    """set_cache (what tests and kforge.bench use to switch directories) forgets the failure."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    good = tmp_path / "good"
    try:
        kforge._C.set_cache(str(blocker / "cache"), True)
        kforge._C.clear_memory_cache()
        kforge._C.reset_cache_stats()
        kforge._C.compile(K1, 90)
        assert kforge.cache_info()["disk_write_failures"] == 1
        kforge._C.set_cache(str(good), True)
        kforge._C.clear_memory_cache()
        kforge._C.compile(K1, 90)
        assert kforge.cache_info()["disk_write_failures"] == 1
        assert [f.name.startswith(f"{K1}-sm_90-") for f in good.iterdir()] == [True]
    finally:
        kforge._C.set_cache(kforge.cache_dir(), kforge._runtime.disk_cache_enabled())
        kforge._C.clear_memory_cache()
    assert len([w for w in recwarn if issubclass(w.category, kforge.KforgeCacheWarning)]) == 1


# ---- a kernel source edited between runs ----------------------------------------------------------------
COMPILE_K1 = f"""
import json, kforge
kforge._C.compile({K1!r}, 90)
info = kforge.cache_info()
info.pop("entries")
print(json.dumps(info))
"""


@pytest.mark.parametrize("edited", [f"{K1}.cu", "common.cuh"])
def test_edited_source_or_header_is_recompiled(edited, tmp_path):
    """The key covers the source and every header it includes: an edit between two processes compiles
    afresh (never the stale CUBIN from disk), and the process after that finds the new entry on disk."""
    kernels = tmp_path / "kernels"
    shutil.copytree(ROOT / "kernels_src", kernels)
    env = {"KFORGE_KERNEL_DIR": str(kernels)}
    cache = tmp_path / "cache"
    first = run_py(COMPILE_K1, cache, env)
    assert (first["nvrtc_compiles"], first["disk_misses"]) == (1, 1)
    assert run_py(COMPILE_K1, cache, env)["disk_hits"] == 1

    with open(kernels / edited, "a") as f:
        f.write("\n// edited between runs: a different text is a different program\n")
    after_edit = run_py(COMPILE_K1, cache, env)
    assert (after_edit["nvrtc_compiles"], after_edit["disk_hits"], after_edit["disk_misses"]) == (1, 0, 1)
    again = run_py(COMPILE_K1, cache, env)
    assert (again["nvrtc_compiles"], again["disk_hits"]) == (0, 1)
    assert len(list(cache.glob(f"{K1}-sm_90-*.cubin"))) == 2  # one entry per text, neither overwritten


# ---- concurrency: threads and processes compiling at once ------------------------------------------------
THREADS = """
import json, sys, threading, kforge
names = sys.argv[1:]
barrier = threading.Barrier(len(names))
results = {}

def work(i, name):
    barrier.wait()  # start together; _C.compile releases the GIL while NVRTC runs
    results[i] = kforge._C.compile(name, 90)

threads = [threading.Thread(target=work, args=(i, n)) for i, n in enumerate(names)]
for t in threads:
    t.start()
for t in threads:
    t.join()
info = kforge.cache_info()
info.pop("entries")
info["results"] = [results[i] for i in range(len(names))]
print(json.dumps(info))
"""


def _start(names: list[str], cache: Path) -> subprocess.Popen:
    argv, env = _python(THREADS, cache)
    return subprocess.Popen(argv + names, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    assert "unusable" not in err and "Traceback" not in err, err
    return json.loads(out.strip().splitlines()[-1])


def _expected_lowered(names: list[str]) -> dict[str, list[str]]:
    # The lowered names of a sequential compile in a fresh cache: what every racer must get.
    return {n: kforge._C.name_expressions(n) for n in names}


def test_two_threads_same_and_different_kernels(tmp_path):
    names = [K1, K1, K2, K3]  # two threads on one kernel, the others on their own
    out = _finish(_start(names, tmp_path))
    assert out["nvrtc_compiles"] == 3  # the two threads on K1 shared one compile
    for name, lowered in zip(names, out["results"]):
        assert len(lowered) == len(kforge._C.name_expressions(name)) and all(lowered), (name, lowered)
    assert out["results"][0] == out["results"][1]
    assert sorted(f.name.split("-sm_90-")[0] for f in tmp_path.iterdir()) == sorted({K1, K2, K3})


def test_two_processes_two_threads_each(tmp_path):
    """Processes A and B, two threads each, both compile K1 (the same entry) and one other kernel
    each, all at once: every cache file is whole afterwards and no temporary file is left."""
    procs = [_start([K1, K2], tmp_path), _start([K1, K3], tmp_path)]
    outs = [_finish(p) for p in procs]
    assert outs[0]["results"][0] == outs[1]["results"][0]
    names = sorted(f.name for f in tmp_path.iterdir())
    assert [n.split("-sm_90-")[0] for n in names] == sorted([K1, K2, K3]), names
    after = _finish(_start([K1, K2, K3], tmp_path))
    assert (after["disk_hits"], after["nvrtc_compiles"], after["disk_corrupt"]) == (3, 0, 0)
    assert after["results"] == [outs[0]["results"][0], outs[0]["results"][1], outs[1]["results"][1]]


# ---- bad arguments at kforge.jit / kforge.compile ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    import torch

    return torch.nn.Linear(4, 4)


def _patterns():
    from kforge.transforms import LlamaPatternTransform

    return LlamaPatternTransform()


@pytest.mark.parametrize("entry", ["jit", "compile"])
@pytest.mark.parametrize("make,message", [
    (lambda m: ((42,), {}), "expected a torch.nn.Module or a function to compile, got int"),
    (lambda m: (("model.pt",), {}), "got str"),
    (lambda m: ((type(m),), {}), "got the class Linear; pass an instance"),
    (lambda m: ((m,), {"fusion": "no"}), "fusion must be True, False or None"),
    (lambda m: ((m,), {"transforms": "one"}), "transforms must be a list of Thunder transforms, got str"),
    (lambda m: ((m,), {"transforms": _patterns()}), "wrap the one given in a list"),
    (lambda m: ((m,), {"transforms": [object()]}), "transforms must be Thunder transforms"),
    (lambda m: ((m,), {"executors": "kforge"}), "executors must be a list of Thunder executors"),
], ids=["int", "str", "class", "fusion", "transforms-str", "transform-unwrapped", "transforms-object",
        "executors-str"])
def test_jit_and_compile_reject_bad_arguments(entry, make, message, tiny_model):
    args, kwargs = make(tiny_model)
    with pytest.raises(TypeError) as e:
        getattr(kforge, entry)(*args, **kwargs)
    assert str(e.value).startswith(f"kforge.{entry}: ") and message in str(e.value), str(e.value)


def test_executors_rejects_a_non_bool_fusion():
    with pytest.raises(TypeError, match="kforge.executors: fusion must be True, False or None"):
        kforge.executors(fusion=1)
