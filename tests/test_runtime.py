"""Runtime: NVRTC compile by name, memory and disk cache, errors, and (GPU) launch, streams, graphs.

CPU tests run in CI (NVRTC compiles without a GPU); GPU tests skip there with a visible reason.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kforge
from conftest import gpu

ROOT = Path(__file__).resolve().parents[1]
KERNEL_FILES = sorted(p.stem for p in (ROOT / "kernels_src").glob("*.cu"))


def run_py(code: str, cache: Path, env_extra: dict | None = None, timeout: int = 300) -> dict:
    """Run `code` in a fresh interpreter with its own kforge cache dir; it prints one JSON line."""
    env = dict(os.environ, KFORGE_CACHE_DIR=str(cache), PYTHONWARNINGS="default")
    env.update(env_extra or {})
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, f"subprocess failed:\n{r.stdout}\n{r.stderr}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["stderr"] = r.stderr
    return out


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty disk cache and an empty memory cache for this test."""
    cache = tmp_path / "cache"
    kforge._C.set_cache(str(cache), True)
    kforge._C.clear_memory_cache()
    kforge._C.reset_cache_stats()
    yield cache
    kforge._C.set_cache(kforge.cache_dir(), kforge._runtime.disk_cache_enabled())
    kforge._C.clear_memory_cache()


# ---- compile every kernel (grows automatically with kernels_src/) ------------------------------------
def test_every_kernel_source_is_registered():
    assert set(KERNEL_FILES) <= set(kforge.kernel_names()), (
        "kernels_src/*.cu without a Program in src/ops/: "
        f"{sorted(set(KERNEL_FILES) - set(kforge.kernel_names()))}")


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("name", KERNEL_FILES)
def test_kernel_compiles(name, arch, fresh_cache):
    lowered = kforge._C.compile(name, arch)
    exprs = kforge._C.name_expressions(name)
    assert len(lowered) == len(exprs) and all(lowered), (name, exprs)
    entry = [e for e in kforge.cache_info()["entries"] if e["name"] == name]
    assert entry and entry[0]["arch"] == f"sm_{arch}" and entry[0]["cubin_bytes"] > 0
    assert entry[0]["source"] == "nvrtc" and entry[0]["compile_ms"] > 0


# ---- the dependent-launch contract ----------------------------------------------------------------
def kernel_bodies(src: str) -> list[tuple[str, str]]:
    """(name, body text after the opening brace) of each `__global__` kernel in a .cu source."""
    out = []
    for m in re.finditer(r"__global__", src):
        i, depth = m.end(), 0
        while src[i] != "{" or depth:  # the body's brace: the first one outside parentheses
            depth += {"(": 1, ")": -1}.get(src[i], 0)
            if src[i] == ";" and not depth:  # a declaration, not a definition
                break
            i += 1
        else:
            out.append((re.findall(r"(\w+)\s*\(", src[m.end():i])[-1], src[i + 1:]))
    return out


def first_statement(body: str) -> str:
    body = re.sub(r"//[^\n]*|/\*.*?\*/", "", body, flags=re.S)
    return body.lstrip().split(";", 1)[0].strip() + ";"


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_every_kernel_waits_for_the_prior_grid_first(name):
    """Every launch is a programmatic dependent on Hopper (Kernel::launch), so a kernel may start while
    the one before it on the stream still runs: its first statement must be kf_wait_prior_grids(),
    before it reads that kernel's output or writes memory that kernel still reads."""
    kernels = kernel_bodies((ROOT / "kernels_src" / f"{name}.cu").read_text())
    assert kernels, f"{name}.cu: no __global__ kernel found (parser out of date?)"
    late = [k for k, body in kernels if first_statement(body) != "kf_wait_prior_grids();"]
    assert not late, f"{name}.cu: kernels not starting with kf_wait_prior_grids(): {late}"


def test_wait_check_rejects_a_late_wait():
    src = ("template <typename T>\n__global__ void __launch_bounds__(f(2), 1)\n  k(const T* x, T* y) {\n"
           "  // comment\n  y[0] = x[0];\n  kf_wait_prior_grids();\n}\n"
           "__global__ void g(int n);\n__global__ void h(int n) { kf_wait_prior_grids(); }\n")
    got = [(k, first_statement(b)) for k, b in kernel_bodies(src)]
    assert got == [("k", "y[0] = x[0];"), ("h", "kf_wait_prior_grids();")]


# ---- memory and disk cache ----------------------------------------------------------------------------
def test_memory_cache_hit(fresh_cache):
    kforge._C.compile("axpy", 90)
    info = kforge.cache_info()
    assert (info["memory_misses"], info["nvrtc_compiles"]) == (1, 1)
    kforge._C.compile("axpy", 90)
    info2 = kforge.cache_info()
    assert info2["nvrtc_compiles"] == 1 and info2["memory_hits"] == info["memory_hits"] + 1
    kforge._C.compile("axpy", 80)  # another arch is another entry
    assert kforge.cache_info()["nvrtc_compiles"] == 2


def test_disk_cache_written_atomically(fresh_cache):
    kforge._C.compile("axpy", 90)
    files = sorted(fresh_cache.iterdir())
    assert len(files) == 1 and files[0].name.startswith("axpy-sm_90-") and files[0].suffix == ".cubin"
    assert not list(fresh_cache.glob("*.tmp.*"))


COMPILE_AXPY = """
import json, kforge
kforge._C.compile("axpy", 90)
print(json.dumps(kforge.cache_info()))
"""


def test_second_process_loads_from_disk_without_nvrtc(tmp_path):
    first = run_py(COMPILE_AXPY, tmp_path)
    assert first["nvrtc_compiles"] == 1 and first["disk_misses"] == 1
    second = run_py(COMPILE_AXPY, tmp_path)
    assert second["nvrtc_compiles"] == 0 and second["disk_hits"] == 1
    assert second["entries"][0]["source"] == "disk"


def test_disk_cache_disabled(tmp_path):
    out = run_py(COMPILE_AXPY, tmp_path, {"KFORGE_DISK_CACHE": "0"})
    assert out["nvrtc_compiles"] == 1 and out["disk_hits"] == 0
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_corrupted_cache_file_is_reported_once_and_recompiled(tmp_path, damage):
    run_py(COMPILE_AXPY, tmp_path)
    (f,) = tmp_path.glob("axpy-sm_90-*.cubin")
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "garbage":
        data = bytearray(os.urandom(len(data)))
    else:
        data = bytearray()
    f.write_bytes(bytes(data))
    damaged = tmp_path.parent / f"damaged-{damage}.bin"
    damaged.write_bytes(bytes(data))
    # The same file damaged twice in one process: both times recompiled, one warning.
    out = run_py(f"""
        import json, warnings, kforge
        from pathlib import Path
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            kforge._C.compile("axpy", 90)
            Path({str(f)!r}).write_bytes(Path({str(damaged)!r}).read_bytes())
            kforge._C.clear_memory_cache()
            kforge._C.compile("axpy", 90)
        info = kforge.cache_info()
        info["warnings"] = [str(x.message) for x in w if issubclass(x.category, kforge.KforgeCacheWarning)]
        print(json.dumps(info))
    """, tmp_path)
    assert len(out["warnings"]) == 1, out["warnings"]
    assert "unusable" in out["warnings"][0] and f.name in out["warnings"][0]
    assert out["nvrtc_compiles"] == 2 and out["disk_corrupt"] == 2
    # The rewritten file is whole again: a third process loads it from disk.
    third = run_py(COMPILE_AXPY, tmp_path)
    assert third["nvrtc_compiles"] == 0 and third["disk_hits"] == 1


def test_processes_racing_on_one_entry_never_tear_the_file(tmp_path):
    code = COMPILE_AXPY
    env = dict(os.environ, KFORGE_CACHE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(6)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert "unusable" not in err
    files = list(tmp_path.iterdir())
    assert len(files) == 1, files  # no temp files left behind
    after = run_py(COMPILE_AXPY, tmp_path)
    assert after["disk_hits"] == 1 and after["nvrtc_compiles"] == 0 and after["disk_corrupt"] == 0


def test_header_change_invalidates_cache(tmp_path, fresh_cache):
    src = tmp_path / "src"
    src.mkdir()
    (src / "helper.cuh").write_text("#define KF_SCALE 2.0f\n")
    (src / "scale.cu").write_text(
        '#include "helper.cuh"\n'
        'template <typename T> __global__ void scale_kernel(T* x) { x[threadIdx.x] *= KF_SCALE; }\n')
    kforge._C.compile_source("scale", str(src), ["scale_kernel<float>"], 90)
    kforge._C.compile_source("scale", str(src), ["scale_kernel<float>"], 90)
    assert kforge.cache_info()["nvrtc_compiles"] == 1  # same sources: served from cache
    (src / "helper.cuh").write_text("#define KF_SCALE 3.0f\n")
    kforge._C.compile_source("scale", str(src), ["scale_kernel<float>"], 90)
    assert kforge.cache_info()["nvrtc_compiles"] == 2


COMPILE_PARTS = """
import json, kforge
lowered = kforge._C.compile_source("parts", {src!r}, {exprs!r}, 90)
info = kforge.cache_info()
info["lowered"] = lowered
print(json.dumps(info))
"""


def test_many_expressions_compile_in_parts_as_one_entry(tmp_path):
    """A program's name expressions go to NVRTC in parts of at most 20 (per element type, on their own
    threads) and come back as one cache entry: every lowered name in expression order, one compile,
    one disk file, and a second process loads all parts from it. Each kernel's lowered name is the one
    NVRTC gives it compiled alone."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "parts.cu").write_text(
        "template <int N> __global__ void add_n(float* x) { x[threadIdx.x] += N; }\n")
    exprs = [f"add_n<{i}>" for i in range(47)]  # three parts: 20, 20, 7
    cache = tmp_path / "cache"
    first = run_py(COMPILE_PARTS.format(src=str(src), exprs=exprs), cache)
    assert first["nvrtc_compiles"] == 1 and len(list(cache.iterdir())) == 1
    assert [e["parts"] for e in first["entries"]] == [3]
    assert len(first["lowered"]) == 47 and len(set(first["lowered"])) == 47
    alone = run_py(COMPILE_PARTS.format(src=str(src), exprs=exprs[30:31]), tmp_path / "cache-alone")
    assert alone["lowered"] == [first["lowered"][30]]
    second = run_py(COMPILE_PARTS.format(src=str(src), exprs=exprs), cache)
    assert second["nvrtc_compiles"] == 0 and second["disk_hits"] == 1
    assert second["lowered"] == first["lowered"] and [e["parts"] for e in second["entries"]] == [3]


@pytest.mark.parametrize("name", ["gelu", "rmsnorm"])
def test_shipped_kernels_split_by_element_type(name, fresh_cache):
    """A shipped program's {T} kernels are compiled per element type, in runs of 20 (rmsnorm: 38
    float, 58 bf16 and 58 half expressions when this was written, 8 parts)."""
    kforge._C.compile(name, 90)
    (entry,) = [e for e in kforge.cache_info()["entries"] if e["name"] == name]
    exprs = kforge._C.name_expressions(name)
    # a kernel's element type is its first template argument (rmsnorm's fp32-x forward storing a
    # 16-bit y names a second type after it)
    first = [e.split("<", 1)[1].split(",")[0].split(">")[0].strip() for e in exprs]
    per_type = [first.count(t) for t in ("float", "bf16", "half")]
    assert sum(per_type) == len(exprs)  # every expression's first argument is an element type
    assert entry["parts"] == sum(-(-n // 20) for n in per_type if n) > 1


@gpu
def test_kernels_of_every_part_launch(fresh_cache):
    """rmsnorm's expressions span several parts (one module each): a kernel from each element type
    launches and computes (its forward against torch's)."""
    import torch.nn.functional as F

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(64, 96, device="cuda", dtype=dtype)
        w = torch.randn(96, device="cuda", dtype=dtype)
        from kforge.ops.rmsnorm import rms_norm

        ref = F.rms_norm(x.float(), (96,), w.float(), 1e-5)
        torch.testing.assert_close(rms_norm(x, w, 1e-5).float(), ref, rtol=2e-2, atol=2e-2)


def test_kernel_coverage_lists_every_instantiation():
    """kernel_coverage() (what the sanitizer matrix reads) has one row per name expression of every
    shipped program, each marked launched or not."""
    rows = kforge._C.kernel_coverage()
    assert {p for p, _, _ in rows} == set(kforge._C.programs())
    assert len(rows) == len(set((p, e) for p, e, _ in rows)) > 300
    assert ("axpy", "axpy_kernel<float>") in {(p, e) for p, e, _ in rows}
    if not torch.cuda.is_available():
        assert not any(u for _, _, u in rows)  # nothing launches without a GPU


@gpu
def test_kernel_coverage_marks_what_launched():
    from conftest import launched

    before = launched()
    kforge._C.axpy(torch.ones(5, device="cuda", dtype=torch.float16), torch.ones(5, device="cuda", dtype=torch.float16))
    assert launched() - before <= {("axpy", "axpy_kernel<half>")}
    assert ("axpy", "axpy_kernel<half>") in launched()


# ---- errors -------------------------------------------------------------------------------------------
def test_compile_error_names_kernel_and_carries_log(tmp_path, fresh_cache):
    (tmp_path / "broken.cu").write_text(
        "__global__ void broken_kernel(float* x) {\n  x[0] = undefined_thing;\n}\n")
    with pytest.raises(kforge.KernelCompileError) as e:
        kforge._C.compile_source("broken", str(tmp_path), [], 90)
    msg = str(e.value)
    assert '"broken"' in msg and "broken.cu" in msg and "sm_90" in msg
    assert "NVRTC log" in msg and "undefined_thing" in msg and "undefined" in msg
    assert isinstance(e.value, kforge.KforgeError) and isinstance(e.value, RuntimeError)


def test_unknown_kernel_name():
    with pytest.raises(kforge.KforgeError, match='unknown kernel "no_such_kernel"'):
        kforge._C.compile("no_such_kernel", 90)


def test_missing_source_file(tmp_path, fresh_cache):
    with pytest.raises(kforge.KforgeError, match="not found"):
        kforge._C.compile_source("absent", str(tmp_path), [], 90)


def test_missing_header(tmp_path, fresh_cache):
    (tmp_path / "needs.cu").write_text('#include "nowhere.cuh"\n')
    with pytest.raises(kforge.KforgeError, match='header "nowhere.cuh" not found'):
        kforge._C.compile_source("needs", str(tmp_path), [], 90)


def test_unsupported_arch(fresh_cache):
    with pytest.raises(kforge.KforgeError, match="cannot compile for sm_11"):
        kforge._C.compile("axpy", 11)


def test_nvrtc_not_found_is_explained(tmp_path):
    r = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import kforge
        kforge._C.configure(kforge.kernel_dir(), "", False, ["/nonexistent/libnvrtc.so.13"])
        kforge._C.compile("axpy", 90)
    """)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "NVRTC not found" in r.stderr and "/nonexistent/libnvrtc.so.13" in r.stderr


def test_import_without_gpu_and_clear_errors():
    r = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import torch, kforge
        assert not torch.cuda.is_available()
        try:
            kforge._C.axpy(torch.ones(3), torch.ones(3))
        except kforge.KforgeError as e:
            print("CPU:", e)
        try:
            kforge._C.device_arch(0)
        except kforge.KforgeError as e:
            print("DEV:", e)
    """)], capture_output=True, text=True, timeout=120, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert r.returncode == 0, r.stderr
    assert "CPU: kforge.axpy: x must be a CUDA tensor, got cpu" in r.stdout
    assert "DEV: kforge: no" in r.stdout  # no CUDA driver / no usable CUDA device


def test_unsupported_dtype_is_rejected_before_device_checks():
    with pytest.raises(kforge.KforgeError, match="kforge.axpy: x must be a CUDA tensor"):
        kforge._C.axpy(torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))


def test_compile_all_reports_every_kernel(fresh_cache):
    out = kforge.compile_all(90)
    assert set(out) == set(kforge.kernel_names())
    assert all(ms > 0 for ms in out.values())
    again = kforge.compile_all(90)
    assert all(ms == 0 for ms in again.values())  # second time: all from cache



@pytest.mark.parametrize("arch,message", [
    (75, "kforge.compile_all: sm_75 is not supported; sm_80 is the minimum architecture kforge supports"),
    (0, "sm_80 is the minimum architecture"),
    ("90", "arch must be an int"),
    (True, "arch must be an int"),
])
def test_compile_all_rejects_unsupported_archs_up_front(arch, message, fresh_cache):
    """A clear ValueError before any compile, not ptxas's log of sm_80 instructions on sm_75."""
    with pytest.raises(ValueError) as e:
        kforge.compile_all(arch)
    assert message in str(e.value)
    assert kforge.cache_info()["nvrtc_compiles"] == 0
    assert kforge.MIN_ARCH == 80

# ---- GPU: launch, streams, graphs, warm start ---------------------------------------------------------
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 7, 8, 1000, 4097, 1 << 20])
def test_axpy_matches_torch(dtype, n):
    x = torch.randn(n, device="cuda").to(dtype)
    y = torch.randn(n, device="cuda").to(dtype)
    out = kforge._C.axpy(x, y, 0.75)
    ref = (0.75 * x.double() + y.double()).to(dtype)
    torch.testing.assert_close(out, ref, rtol=0, atol=0) if dtype == torch.float32 else \
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    assert torch.isfinite(out).all()


@gpu
def test_axpy_misaligned_and_strided_inputs():
    base = torch.randn(1001, device="cuda", dtype=torch.bfloat16)
    x, y = base[1:], torch.randn(1000, device="cuda", dtype=torch.bfloat16)  # x is 2 bytes off
    out = kforge._C.axpy(x, y, 2.0)
    torch.testing.assert_close(out.float(), (2 * x.float() + y.float()), rtol=1e-2, atol=1e-2)
    xt = torch.randn(64, 48, device="cuda").t()  # non-contiguous: made contiguous by the launcher
    yt = torch.randn(48, 64, device="cuda")
    torch.testing.assert_close(kforge._C.axpy(xt, yt, 1.0), xt + yt)


@gpu
@pytest.mark.parametrize("where", ["default stream", "side stream", "graph"])
def test_back_to_back_dependent_launches_see_each_others_writes(where):
    """Every launch is a programmatic dependent on Hopper: a long chain where each kernel reads the
    previous one's output, and (the caching allocator recycling freed outputs) writes memory that the
    kernel before it reads, must give exact results. Integer-valued floats: every sum is exact."""
    n, steps = 1 << 24, 64
    x0 = torch.randint(-8, 8, (n,), device="cuda").float()
    y = torch.randint(-4, 4, (n,), device="cuda").float()

    def chain():
        x = x0
        for i in range(steps):
            x = kforge._C.axpy(x, y, 1.0)
            if i % 16 == 7:  # a torch kernel in between (a plain launch before a dependent one)
                x = x.neg().neg()
        return x

    chain()  # compile and load outside any capture
    torch.cuda.synchronize()
    if where == "graph":
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = chain()
        x0.add_(1.0)  # new inputs, same buffers
        g.replay()
    elif where == "side stream":
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            out = chain()
        torch.cuda.current_stream().wait_stream(s)
    else:
        out = chain()
    torch.cuda.synchronize()
    assert torch.equal(out, x0 + steps * y)


@gpu
def test_launch_uses_current_stream():
    # If the kernel ran on the default stream it would read x before the side stream's
    # (deliberately delayed) fill and the result would be stale.
    s = torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    y = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)
        x.fill_(3.0)
        out = kforge._C.axpy(x, y, 2.0)
    s.synchronize()
    assert torch.all(out == 7.0)


@gpu
def test_cuda_graph_capture_and_replay():
    x = torch.randn(4096, device="cuda")
    y = torch.randn(4096, device="cuda")
    kforge._C.axpy(x, y, 1.5)  # warm up: compile and load outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = kforge._C.axpy(x, y, 1.5)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, 1.5 * x + y)


@gpu
def test_launch_error_names_kernel_and_cuda_error():
    x = torch.randn(100, device="cuda")
    with pytest.raises(kforge.KforgeError) as e:
        kforge._C.axpy(x, x, 1.0, block=4096)  # more threads per block than any GPU allows
    msg = str(e.value)
    assert "axpy_kernel" in msg and "CUDA_ERROR" in msg and "cuda:0" in msg


@gpu
def test_wrong_device_and_dtype_errors():
    x = torch.randn(10, device="cuda")
    with pytest.raises(kforge.KforgeError, match="y must be a CUDA tensor on cuda:0"):
        kforge._C.axpy(x, torch.randn(10))
    with pytest.raises(kforge.KforgeError, match="dtype"):
        kforge._C.axpy(x, torch.randn(10, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(kforge.KforgeError, match="dtype float64 is not supported"):
        kforge._C.axpy(x.double(), x.double())


@gpu
def test_warm_start_from_disk_skips_nvrtc(tmp_path):
    code = """
        import json, torch, kforge
        x = torch.randn(1000, device="cuda")
        out = kforge._C.axpy(x, x, 1.0)
        assert torch.allclose(out, 2 * x)
        print(json.dumps(kforge.cache_info()))
    """
    cold = run_py(code, tmp_path)
    assert cold["nvrtc_compiles"] == 1
    warm = run_py(code, tmp_path)
    assert warm["nvrtc_compiles"] == 0 and warm["disk_hits"] == 1


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (per-device module loading)")
def test_launch_on_second_device_uses_its_module():
    for dev in ("cuda:1", "cuda:0", "cuda:1"):
        x = torch.randn(1000, device=dev)
        torch.testing.assert_close(kforge._C.axpy(x, x, 1.0), 2 * x)
    with torch.cuda.device(0):  # current device 0, tensors on 1: the launcher follows the tensors
        x = torch.randn(1000, device="cuda:1")
        torch.testing.assert_close(kforge._C.axpy(x, x, 1.0), 2 * x)


# ---- environment variables, logging, version ---------------------------------------------------------
@pytest.mark.parametrize("value,expected", [
    *[(v, False) for v in ("0", "false", "FALSE", "False", "off", "OFF", "no", "No", " 0 ")],
    *[(v, True) for v in ("1", "true", "TRUE", "on", "yes", "Yes")],
    ("", True),  # empty: the default
])
def test_boolean_knobs_share_one_parser(value, expected, monkeypatch):
    from kforge import _env

    for name in ("KFORGE_DISK_CACHE", "KFORGE_FUSION", "KFORGE_DEPENDENT_LAUNCH"):
        monkeypatch.setenv(name, value)
        assert _env.flag(name) is expected, (name, value)


@pytest.mark.parametrize("value", ["maybe", "2", "nope", "enabled"])
def test_unknown_boolean_value_names_the_variable(value, monkeypatch):
    from kforge import _env

    monkeypatch.setenv("KFORGE_DISK_CACHE", value)
    with pytest.raises(_env.KforgeEnvError) as e:
        _env.flag("KFORGE_DISK_CACHE")
    assert str(e.value).startswith(f"KFORGE_DISK_CACHE={value!r} is not understood: use 1 / true / on / yes "
                                   "or 0 / false / off / no")
    assert isinstance(e.value, ValueError)


def test_unset_knobs_take_their_defaults(monkeypatch):
    from kforge import _env

    for name in _env.KNOBS:
        monkeypatch.delenv(name, raising=False)
    assert _env.flag("KFORGE_DISK_CACHE") and _env.flag("KFORGE_FUSION") and _env.flag("KFORGE_DEPENDENT_LAUNCH")
    assert _env.text("KFORGE_COMMIT") is None and _env.text("KFORGE_NVRTC") is None


@pytest.mark.parametrize("name", ["KFORGE_DISK_CACHE", "KFORGE_DEPENDENT_LAUNCH"])
def test_import_stops_on_a_malformed_knob(name):
    r = subprocess.run([sys.executable, "-c", "import kforge"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, **{name: "sometimes"}))
    assert r.returncode != 0
    assert f"KforgeEnvError: {name}='sometimes' is not understood" in r.stderr


def test_disk_cache_off_in_capitals(tmp_path):
    """"FALSE" meant on before the one parser."""
    out = run_py(COMPILE_AXPY, tmp_path, {"KFORGE_DISK_CACHE": "FALSE"})
    assert out["nvrtc_compiles"] == 1 and out["disk_misses"] == 0
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_every_knob_is_read_by_env_and_documented():
    """Every KFORGE_* variable in python/, src/ and scripts/ is one of kforge._env.KNOBS and in the
    README's table; none is read from the environment anywhere but kforge/_env.py."""
    from kforge import _env

    not_variables = {"KFORGE_BIND_OP", "KFORGE_OUTPUT_DIR"}  # a C++ macro, a CMake variable
    found: dict[str, str] = {}
    readers = []
    for top in ("python", "src", "scripts"):
        for path in (ROOT / top).rglob("*"):
            if path.suffix not in (".py", ".cpp", ".h", ".sh", ".cu", ".cuh") or "kernels_src" in path.parts:
                continue
            text = path.read_text(encoding="utf-8")
            for name in re.findall(r"\bKFORGE_[A-Z_]+\b", text):
                found.setdefault(name, str(path.relative_to(ROOT)))
            # the fusion package's own KFORGE_FUSION check predates kforge._env and agrees with it
            if path.name != "_env.py" and "fusion" not in path.parts and re.search(
                    r"(environ\.get|getenv)\(\s*[\"']KFORGE_", text):
                readers.append(str(path.relative_to(ROOT)))
    assert not readers, readers
    unknown = {n: p for n, p in found.items() if n not in not_variables and n not in _env.KNOBS}
    assert not unknown, unknown
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert all(f"| `{name}` |" in readme for name in _env.KNOBS), [n for n in _env.KNOBS if f"| `{n}` |" not in readme]


LOGGED_COMPILE = """
import json, logging, kforge
records = []
class Keep(logging.Handler):
    def emit(self, r):
        records.append((r.levelname, r.getMessage()))
log = logging.getLogger("kforge")
log.addHandler(Keep())
log.setLevel(logging.DEBUG)
kforge._C.compile("axpy", 90)
kforge._C.clear_memory_cache()
kforge._C.compile("axpy", 90)
print(json.dumps(records))
"""


def test_runtime_logs_nvrtc_compiles_and_cache_hits(tmp_path):
    r = subprocess.run([sys.executable, "-c", LOGGED_COMPILE], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, KFORGE_CACHE_DIR=str(tmp_path)))
    assert r.returncode == 0, r.stderr
    records = [tuple(x) for x in json.loads(r.stdout.strip().splitlines()[-1])]
    loaded = [m for lvl, m in records if lvl == "INFO" and m.startswith("kforge: loaded NVRTC ")]
    assert len(loaded) == 1 and kforge._C.nvrtc_library() in loaded[0]
    assert any(lvl == "INFO" and re.fullmatch(r"kforge: compiled axpy for sm_90 with NVRTC in \d+ ms "
                                              r"\(\d+ bytes of CUBIN( in \d+ parts)?\)", m) for lvl, m in records), records
    assert ("DEBUG", f"kforge: axpy sm_90: disk cache hit ({next(tmp_path.iterdir())})") in records
    assert r.stderr == ""  # a library prints nothing unless the application configures logging


def test_nvrtc_found_by_cuda_pathfinder_comes_first(monkeypatch):
    pathfinder = pytest.importorskip("cuda.pathfinder")
    from kforge import _runtime

    monkeypatch.delenv("KFORGE_NVRTC", raising=False)
    found = pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path
    assert _runtime.nvrtc_candidates()[0] == found
    monkeypatch.setenv("KFORGE_NVRTC", "/opt/my/libnvrtc.so.13")
    assert _runtime.nvrtc_candidates()[0] == "/opt/my/libnvrtc.so.13"


def test_version_is_written_once():
    from kforge import _version

    assert kforge.__version__ == _version.__version__
    setup_py = (ROOT / "setup.py").read_text(encoding="utf-8")
    assert "version=read_version()" in setup_py and f'"{kforge.__version__}"' not in setup_py
    assert 'requires = ["setuptools' in (ROOT / "pyproject.toml").read_text(encoding="utf-8")


def test_the_runtime_uses_no_iostreams():
    """src/ reads, writes and formats text with C stdio and std::string only. libstdc++'s streams and
    locale facets have crashed inside LibTorch processes: std::regex, and a number written through an
    ostringstream (the first tuned GEMM call segfaulted on a GPU machine); CPU runs never reach most
    of those paths, so the rule is checked on the sources."""
    src = Path(__file__).resolve().parent.parent / "src"
    banned = re.compile(r"#include\s*<(sstream|fstream|iostream|istream|ostream|iomanip|regex|locale)>"
                        r"|std::(i|o)?(string|f)stream\b|std::(regex|cout|cerr|locale)\b")
    found = []
    for path in sorted(src.rglob("*")):
        if path.suffix not in (".cpp", ".h", ".hpp", ".cc"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//", 1)[0]
            if banned.search(code):
                found.append(f"{path.relative_to(src.parent)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
