"""gelu (tanh approximation): launchers against a float64 reference (forward and backward): the 16-byte
pack kernels (full and partial blocks, scalar tail) and the scalar kernels that misaligned pointers
take, saturation, > 2^31 elements, and the Thunder claim.

CPU tests: decline reasons (exact gelu, CPU tensors, fp64), the fallback to torch on CPU tensors, and
the Thunder plumbing (metas, grad transform) with the launchers swapped for a torch reference.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import thunder
from thunder.core.trace import TraceCtx, tracectx

import kforge
from conftest import DTYPES, assert_close, gpu, proxy, randn, swap_launchers
from kforge import _thunder
from kforge.ops import gelu as ge


def gelu_tanh64(x64: torch.Tensor) -> torch.Tensor:
    """gelu (tanh approximation) in float64 as x * sigmoid(2u), the same function as
    0.5 x (1 + tanh(u)). torch's float64 gelu evaluates 1 + tanh(u), which cancels in the negative
    tail: 1.4 % off at x = -6.9, and 0 instead of -4e-18 at x = -7.5, so a lone tail element (shape
    (1,), inputs of scale 3) failed the kernel against a wrong reference."""
    u = math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64**3)
    return x64 * torch.sigmoid(2.0 * u)


def reference(x, dout):
    """float64 gelu(x) and dout * gelu'(x) from the same (rounded) inputs."""
    x64 = x.detach().double().requires_grad_(True)
    out = gelu_tanh64(x64)
    out.backward(dout.double())
    return out.detach(), x64.grad


def test_reference_is_accurate_in_the_tails():
    # Against 50-digit values (mpmath) of 0.5 x (1 + tanh(u)); torch's float64 gelu misses the first
    # two by 1.4 % and 100 %.
    x = torch.tensor([-6.90625, -7.5, -5.0, -3.0, 2.0], dtype=torch.float64)
    exact = torch.tensor([-7.000405609655221e-15, -4.01626821751414e-18, -2.291796196629506e-07,
                          -0.003637392081773019, 1.954597694087775], dtype=torch.float64)
    torch.testing.assert_close(gelu_tanh64(x), exact, rtol=1e-13, atol=0)
    # Elsewhere it is torch's function.
    y = torch.linspace(-4, 6, 1001, dtype=torch.float64)
    torch.testing.assert_close(gelu_tanh64(y), F.gelu(y, approximate="tanh"), rtol=1e-12, atol=1e-15)


def check_against_reference(x, dout, dtype):
    out, dx = kforge._C.gelu_forward(x), kforge._C.gelu_backward(dout, x)
    r_out, r_dx = reference(x, dout)
    assert out.dtype == dx.dtype == dtype and out.shape == dx.shape == x.shape
    assert_close(out, r_out, dtype, "out")
    assert_close(dx, r_dx, dtype, "dx")


def misaligned(t):
    """A copy of t one element off a 16-byte boundary."""
    off = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape).copy_(t)
    assert off.data_ptr() % 16 != 0
    return off


# 16-byte packs plus every scalar-tail length; 1-element and 3-D inputs. A block covers P * B = 512
# packs (2048 fp32 / 4096 16-bit elements): shapes below one block (partial block only), exact
# multiples of a block (4096, 8 x 3072: the last block is empty of packs), and many full blocks plus
# a partial one and a scalar tail.
SHAPES = [(1,), (7,), (1000,), (4096,), (8192 + 9,), (8, 3072), (3, 5, 771), ((1 << 20) + 3,),
          (64, 16384 + 5), (33, 3072 + 1)]


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_matches_float64_reference(dtype, shape):
    x = randn(*shape, dtype=dtype, scale=3.0)
    dout = randn(*shape, dtype=dtype)
    check_against_reference(x, dout, dtype)


@gpu
@pytest.mark.parametrize("v", [-6.90625, -7.5, -8.5, -9.0, -4.0, 5.0])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_single_elements_in_the_tails(dtype, v):
    # One element alone, so the relative error is that element's: the negative tail (values down to
    # 1e-29) is where a reference through 1 + tanh(u) was wrong and where cancellation would show.
    x = torch.tensor([v], device="cuda").to(dtype)
    dout = torch.tensor([-1.375], device="cuda").to(dtype)
    check_against_reference(x, dout, dtype)


@gpu
@pytest.mark.parametrize("align", ["aligned", "misaligned"])
@pytest.mark.parametrize("reps", [1, 1000], ids=lambda r: f"x{r}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_saturation_and_extremes(dtype, reps, align):
    """Far tails: gelu -> x / 0 and gelu' -> 1 / 0 without inf or NaN from the exp overflowing.
    15 values (scalar tail / partial block), and repeated 1000 times (full blocks); misaligned: the
    scalar kernels."""
    vals = [-1e4, -100.0, -20.0, -10.0, -5.0, -1.0, -0.75, -1e-3, 0.0, 1e-3, 0.5, 3.0, 10.0, 100.0, 1e4]
    x = torch.tensor(vals, device="cuda").repeat(reps).to(dtype)
    if align == "misaligned":
        x = misaligned(x)
    dout = torch.ones_like(x)
    out, dx = kforge._C.gelu_forward(x), kforge._C.gelu_backward(dout, x)
    r_out, r_dx = reference(x, dout)
    assert torch.isfinite(out).all() and torch.isfinite(dx).all()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), r_out, rtol=tol, atol=tol)
    torch.testing.assert_close(dx.double(), r_dx, rtol=tol, atol=tol)


@gpu
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_misaligned_and_strided_inputs(dtype):
    """A view off a 16-byte boundary (x or dout) takes the scalar kernels; a strided view is copied
    first (then the pack kernels)."""
    n = 4099
    x, dout = randn(n, dtype=dtype, scale=3.0), randn(n, dtype=dtype)
    check_against_reference(misaligned(x), dout, dtype)
    check_against_reference(x, misaligned(dout), dtype)
    xs, ds = randn(96, 64, dtype=dtype).t(), randn(96, 64, dtype=dtype).t()
    check_against_reference(xs, ds, dtype)


@gpu
@pytest.mark.parametrize("align", ["aligned", "misaligned"])
@pytest.mark.bigmem
def test_more_than_2_31_elements(align):
    """64-bit offsets: the packs and the scalar tail (aligned), or the scalar kernels' grid-stride
    loop (misaligned), past element 2^31 are right."""
    n = (1 << 31) + (1 << 20) + 5
    need = 4 * n * 2 + (2 << 30)  # x, dout, out, dx in bf16, plus slack for the references
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB free GPU memory, {free / 2**30:.1f} GiB free")
    gen = torch.Generator(device="cuda").manual_seed(0)
    off = 1 if align == "misaligned" else 0  # views one element into their buffers
    x = torch.randn(n + off, device="cuda", generator=gen, dtype=torch.bfloat16)[off:].mul_(3)
    dout = torch.randn(n + off, device="cuda", generator=gen, dtype=torch.bfloat16)[off:]
    assert (x.data_ptr() % 16 != 0) == (dout.data_ptr() % 16 != 0) == bool(off)
    out = kforge._C.gelu_forward(x)
    dx = kforge._C.gelu_backward(dout, x)
    for start in (0, (1 << 31) - (1 << 16), n - (1 << 16)):  # head, across 2^31, tail
        sl = slice(start, start + (1 << 17))
        r_out, r_dx = reference(x[sl], dout[sl])
        assert_close(out[sl], r_out, torch.bfloat16, f"out[{start}:]")
        assert_close(dx[sl], r_dx, torch.bfloat16, f"dx[{start}:]")


@gpu
def test_launcher_rejects_bad_arguments():
    x = randn(16)
    with pytest.raises(kforge.KforgeError, match="dout has shape"):
        kforge._C.gelu_backward(randn(15), x)
    with pytest.raises(kforge.KforgeError, match="dout has dtype"):
        kforge._C.gelu_backward(randn(16, dtype=torch.bfloat16), x)
    with pytest.raises(kforge.KforgeError, match="not supported"):
        kforge._C.gelu_forward(x.double())


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_thunder_jit_uses_kforge(dtype):
    x = randn(4, 33, 3072, dtype=dtype, scale=3.0).requires_grad_(True)
    dout = randn(4, 33, 3072, dtype=dtype)

    def fn(x):
        return F.gelu(x, approximate="tanh")

    jfn = thunder.jit(fn, executors=[kforge.executor])
    out = jfn(x)
    (dx,) = torch.autograd.grad(out, (x,), dout)
    assert "kforge_gelu_forward" in str(thunder.last_traces(jfn)[-1])
    assert "kforge_gelu_backward" in str(thunder.last_backward_traces(jfn)[-1])
    r_out, r_dx = reference(x, dout)
    assert_close(out, r_out, dtype, "out")
    assert_close(dx, r_dx, dtype, "dx")
    with torch.no_grad():  # inference: the execution transform
        jinf = thunder.jit(fn, executors=[kforge.executor])
        assert_close(jinf(x), r_out, dtype, "inference out")
        assert "kforge_gelu_forward" in str(thunder.last_traces(jinf)[-1])


@gpu
def test_thunder_leaves_exact_gelu_to_torch_on_gpu():
    _thunder.reset_declines()
    x = randn(8, 64)
    jfn = thunder.jit(lambda x: F.gelu(x), executors=[kforge.executor])
    torch.testing.assert_close(jfn(x), F.gelu(x))
    assert "kforge_gelu" not in str(thunder.last_traces(jfn)[-1])
    assert any("approximate='none'" in r for r in _thunder.declines()["gelu"])


# ---- CPU: declines, fallback, plumbing ----------------------------------------------------------------
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_cpu_tensors_fall_back_to_torch(approximate):
    _thunder.reset_declines()
    x = randn(5, 37, device="cpu", scale=3.0).requires_grad_(True)
    dout = randn(5, 37, device="cpu")

    def fn(x):
        return F.gelu(x, approximate=approximate)

    jfn = thunder.jit(fn, executors=[kforge.executor])
    out = jfn(x)
    (dx,) = torch.autograd.grad(out, (x,), dout)
    assert "kforge_" not in str(thunder.last_traces(jfn)[-1])
    ref = fn(x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(dx, torch.autograd.grad(ref, (x,), dout)[0])
    expected = "not CUDA" if approximate == "tanh" else "approximate='none'"
    reasons = _thunder.declines()["gelu"]
    assert any(r.startswith("gelu: ") and expected in r for r in reasons), reasons


def test_bindings_take_no_variant():
    """One kernel choice per input (the launcher's); no A/B `variant` keyword."""
    for fn in (kforge._C.gelu_forward, kforge._C.gelu_backward):
        assert "variant" not in fn.__doc__, fn.__doc__
    x = randn(16, device="cpu")
    with pytest.raises(TypeError):
        kforge._C.gelu_forward(x, variant=3)
    with pytest.raises(TypeError):
        kforge._C.gelu_backward(x, x, variant=3)


def test_launchers_reject_cpu_tensors():
    x = randn(16, device="cpu")
    with pytest.raises(kforge.KforgeError, match="gelu_forward: x must be a CUDA tensor"):
        kforge._C.gelu_forward(x)
    with pytest.raises(kforge.KforgeError, match="gelu_backward: x must be a CUDA tensor"):
        kforge._C.gelu_backward(x, x)


def test_checker_accepts_and_declines_with_reasons():
    check = ge._checker
    with tracectx(TraceCtx()):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert check(proxy((8, 3072), dtype=dtype), approximate="tanh") is None
        cases = {
            "approximate='none'": check(proxy((8, 3072))),
            "not CUDA": check(proxy((8, 3072), device="cpu"), approximate="tanh"),
            "float64": check(proxy((8, 3072), dtype=torch.float64), approximate="tanh"),
            "empty": check(proxy((0, 3072)), approximate="tanh"),
        }
    for expected, reason in cases.items():
        assert reason is not None and expected in reason, (expected, reason)


# Thunder plumbing without a GPU: the claim's metas and grad transform run for real; only the kforge
# launchers are swapped for torch and the checker accepts CPU tensors.
@pytest.fixture
def cpu_reference_launchers(monkeypatch):
    swap_launchers(monkeypatch, ge, {
        ge.gelu_forward: lambda x: F.gelu(x, approximate="tanh"),
        ge.gelu_backward: lambda dout, x: torch.ops.aten.gelu_backward(dout, x, approximate="tanh"),
    })


def test_thunder_plumbing_with_reference_launchers(cpu_reference_launchers):
    x = randn(3, 40, device="cpu", scale=3.0).requires_grad_(True)
    dout = randn(3, 40, device="cpu")

    def fn(x):
        return F.gelu(x, approximate="tanh") * 2

    jfn = thunder.jit(fn, executors=[kforge.executor])
    out = jfn(x)
    (dx,) = torch.autograd.grad(out, (x,), dout)
    fwd, bwd = str(thunder.last_traces(jfn)[-1]), str(thunder.last_backward_traces(jfn)[-1])
    assert "kforge_gelu_forward" in fwd and "kforge_gelu_backward" in bwd, (fwd, bwd)
    ref = fn(x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(dx, torch.autograd.grad(ref, (x,), dout)[0])
