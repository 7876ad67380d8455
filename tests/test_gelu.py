"""gelu, tanh approximation and exact (erf): launchers against a float64 reference (forward and
backward) in both modes: the 16-byte pack kernels (full and partial blocks, scalar tail) and the
scalar kernels that misaligned pointers take, the tails, saturation, > 2^31 elements, and the Thunder
claim of `F.gelu(x)` / `F.gelu(x, approximate="tanh")` / `nn.GELU()`.

CPU tests: the float64 references themselves, decline reasons (CPU tensors, fp64, an unknown
`approximate`), the fallback to torch on CPU tensors, and the Thunder plumbing (metas, grad
transform) in both modes with the launchers swapped for a torch reference.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
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


def gelu_erf64(x64: torch.Tensor) -> torch.Tensor:
    """Exact gelu in float64 as x * Phi(x), Phi(x) = erfc(-x / sqrt 2) / 2: torch's float64
    0.5 (1 + erf(x / sqrt 2)) cancels in the negative tail, and torch.special.ndtr returns 0 at -9."""
    return x64 * (0.5 * torch.special.erfc(-x64 / math.sqrt(2.0)))


REFERENCES = {"tanh": gelu_tanh64, "none": gelu_erf64}
MODES = list(REFERENCES)


def reference(x, dout, approximate="tanh"):
    """float64 gelu(x) and dout * gelu'(x) from the same (rounded) inputs."""
    x64 = x.detach().double().requires_grad_(True)
    out = REFERENCES[approximate](x64)
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


def test_erf_reference_is_accurate_in_the_tails():
    # x Phi(x) and Phi(x) + x phi(x) against 30-digit values (mpmath); torch's float64 gelu,
    # 0.5 x (1 + erf(x / sqrt 2)), loses all digits past x = -8.
    x = torch.tensor([-9.0, -6.5, -3.0, -0.5, 2.0], dtype=torch.float64, requires_grad=True)
    exact = torch.tensor([-1.0157295653584566e-18, -2.6104003795084266e-10, -4.0496940948902836e-03,
                          -1.5426876936299345e-01, 1.9544997361036416], dtype=torch.float64)
    exact_grad = torch.tensor([-9.1389373739066393e-18, -1.6950517937572626e-09, -1.1945647204183927e-02,
                               1.3250487534383716e-01, 1.0852318010781969], dtype=torch.float64)
    y = gelu_erf64(x)
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(y.detach(), exact, rtol=1e-12, atol=0)
    torch.testing.assert_close(g, exact_grad, rtol=1e-10, atol=0)
    z = torch.linspace(-4, 6, 1001, dtype=torch.float64)
    torch.testing.assert_close(gelu_erf64(z), F.gelu(z), rtol=1e-12, atol=1e-15)


def check_against_reference(x, dout, dtype, approximate="tanh"):
    out = kforge._C.gelu_forward(x, approximate)
    dx = kforge._C.gelu_backward(dout, x, approximate)
    r_out, r_dx = reference(x, dout, approximate)
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
@pytest.mark.parametrize("approximate", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_matches_float64_reference(dtype, shape, approximate):
    x = randn(*shape, dtype=dtype, scale=3.0)
    dout = randn(*shape, dtype=dtype)
    check_against_reference(x, dout, dtype, approximate)


@gpu
@pytest.mark.parametrize("approximate", MODES)
@pytest.mark.parametrize("v", [-6.90625, -7.5, -8.5, -9.0, -4.0, -1.0, -0.5, 0.75, 5.0])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_single_elements_in_the_tails(dtype, v, approximate):
    # One element alone, so the relative error is that element's: the negative tail (values down to
    # 1e-29) is where a reference through 1 + tanh(u) was wrong and where cancellation would show
    # (1 + erf(x / sqrt 2) in the exact mode; the kernel takes erfc).
    x = torch.tensor([v], device="cuda").to(dtype)
    dout = torch.tensor([-1.375], device="cuda").to(dtype)
    check_against_reference(x, dout, dtype, approximate)


@gpu
@pytest.mark.parametrize("approximate", MODES)
@pytest.mark.parametrize("align", ["aligned", "misaligned"])
@pytest.mark.parametrize("reps", [1, 1000], ids=lambda r: f"x{r}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_saturation_and_extremes(dtype, reps, align, approximate):
    """Far tails: gelu -> x / 0 and gelu' -> 1 / 0 without inf or NaN from the exp overflowing.
    15 values (scalar tail / partial block), and repeated 1000 times (full blocks); misaligned: the
    scalar kernels."""
    vals = [-1e4, -100.0, -20.0, -10.0, -5.0, -1.0, -0.75, -1e-3, 0.0, 1e-3, 0.5, 3.0, 10.0, 100.0, 1e4]
    x = torch.tensor(vals, device="cuda").repeat(reps).to(dtype)
    if align == "misaligned":
        x = misaligned(x)
    dout = torch.ones_like(x)
    out, dx = kforge._C.gelu_forward(x, approximate), kforge._C.gelu_backward(dout, x, approximate)
    r_out, r_dx = reference(x, dout, approximate)
    assert torch.isfinite(out).all() and torch.isfinite(dx).all()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), r_out, rtol=tol, atol=tol)
    torch.testing.assert_close(dx.double(), r_dx, rtol=tol, atol=tol)


@gpu
@pytest.mark.parametrize("approximate", MODES)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_misaligned_and_strided_inputs(dtype, approximate):
    """A view off a 16-byte boundary (x or dout) takes the scalar kernels; a strided view is copied
    first (then the pack kernels)."""
    n = 4099
    x, dout = randn(n, dtype=dtype, scale=3.0), randn(n, dtype=dtype)
    check_against_reference(misaligned(x), dout, dtype, approximate)
    check_against_reference(x, misaligned(dout), dtype, approximate)
    xs, ds = randn(96, 64, dtype=dtype).t(), randn(96, 64, dtype=dtype).t()
    check_against_reference(xs, ds, dtype, approximate)


@gpu
@pytest.mark.parametrize("approximate", MODES)
@pytest.mark.parametrize("align", ["aligned", "misaligned"])
@pytest.mark.bigmem
def test_more_than_2_31_elements(align, approximate):
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
    out = kforge._C.gelu_forward(x, approximate)
    dx = kforge._C.gelu_backward(dout, x, approximate)
    for start in (0, (1 << 31) - (1 << 16), n - (1 << 16)):  # head, across 2^31, tail
        sl = slice(start, start + (1 << 17))
        r_out, r_dx = reference(x[sl], dout[sl], approximate)
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
@pytest.mark.parametrize("approximate", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_thunder_jit_uses_kforge(dtype, approximate):
    x = randn(4, 33, 3072, dtype=dtype, scale=3.0).requires_grad_(True)
    dout = randn(4, 33, 3072, dtype=dtype)

    def fn(x):
        return F.gelu(x, approximate=approximate)

    jfn = thunder.jit(fn, executors=[kforge.executor])
    out = jfn(x)
    (dx,) = torch.autograd.grad(out, (x,), dout)
    assert "kforge_gelu_forward" in str(thunder.last_traces(jfn)[-1])
    assert "kforge_gelu_backward" in str(thunder.last_backward_traces(jfn)[-1])
    r_out, r_dx = reference(x, dout, approximate)
    assert_close(out, r_out, dtype, "out")
    assert_close(dx, r_dx, dtype, "dx")
    with torch.no_grad():  # inference: the execution transform
        jinf = thunder.jit(fn, executors=[kforge.executor])
        assert_close(jinf(x), r_out, dtype, "inference out")
        assert "kforge_gelu_forward" in str(thunder.last_traces(jinf)[-1])


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nn_gelu_module_is_claimed(dtype):
    """`nn.GELU()` (exact, nanoGPT's MLP) inside a module: claimed in both directions."""
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda().to(dtype)
    x = randn(3, 7, 64, dtype=dtype)
    jm = thunder.jit(mlp, executors=[kforge.executor, *thunder.get_default_executors()])
    out = jm(x)
    out.sum().backward()
    assert "kforge_gelu_forward" in str(thunder.last_traces(jm)[-1])
    assert "kforge_gelu_backward" in str(thunder.last_backward_traces(jm)[-1])
    h = mlp[0](x).detach()
    r_act, _ = reference(h, torch.ones_like(h), "none")
    ref = F.linear(r_act, mlp[2].weight.double(), mlp[2].bias.double())
    assert_close(out, ref, dtype, "out", tol=2 * (1e-5 if dtype == torch.float32 else 8e-3))


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
    reasons = _thunder.declines()["gelu"]
    assert any(r.startswith("gelu: ") and "not CUDA" in r for r in reasons), reasons


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
        kforge._C.gelu_backward(x, x, "none")


def test_launchers_reject_an_unknown_approximation():
    x = randn(16, device="cpu")
    with pytest.raises(kforge.KforgeError, match='gelu_forward: approximate must be "tanh" or "none", got "erf"'):
        kforge._C.gelu_forward(x, "erf")
    with pytest.raises(kforge.KforgeError, match='gelu_backward: approximate must be "tanh" or "none"'):
        kforge._C.gelu_backward(x, x, "sigmoid")


def test_checker_accepts_and_declines_with_reasons():
    check = ge._checker
    with tracectx(TraceCtx()):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert check(proxy((8, 3072), dtype=dtype), approximate="tanh") is None
            assert check(proxy((8, 3072), dtype=dtype), approximate="none") is None
            assert check(proxy((8, 3072), dtype=dtype)) is None  # torch's default: exact
        cases = {
            "approximate='erf' is not one of": check(proxy((8, 3072)), approximate="erf"),
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
        ge.gelu_forward: lambda x, approximate: F.gelu(x, approximate=approximate),
        ge.gelu_backward: lambda dout, x, approximate: torch.ops.aten.gelu_backward(dout, x, approximate=approximate),
    })


@pytest.mark.parametrize("approximate", MODES)
def test_thunder_plumbing_with_reference_launchers(cpu_reference_launchers, approximate):
    x = randn(3, 40, device="cpu", scale=3.0).requires_grad_(True)
    dout = randn(3, 40, device="cpu")

    def fn(x):
        return F.gelu(x, approximate=approximate) * 2

    jfn = thunder.jit(fn, executors=[kforge.executor])
    out = jfn(x)
    (dx,) = torch.autograd.grad(out, (x,), dout)
    fwd, bwd = str(thunder.last_traces(jfn)[-1]), str(thunder.last_backward_traces(jfn)[-1])
    assert "kforge_gelu_forward" in fwd and "kforge_gelu_backward" in bwd, (fwd, bwd)
    ref = fn(x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(dx, torch.autograd.grad(ref, (x,), dout)[0])


# ---- property-based (hypothesis) ----------------------------------------------------------------
# Element counts around the vector width (16-byte packs of V = 4 / 8, two per thread, 256-thread
# blocks: 2 * 256 * V elements a block) and 1; offsets 1..7 elements make the misaligned inputs that
# take the scalar grid-stride kernel.
@gpu
@pytest.mark.sanitize
@settings(max_examples=40)
@given(n=st.one_of(st.integers(1, 40), st.sampled_from([4, 8, 2048, 4096, 8192]).flatmap(lambda e: st.integers(e - 3, e + 3))),
       lead=st.sampled_from([(), (3,), (2, 5)]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       approximate=st.sampled_from(["tanh", "none"]), off=st.integers(0, 7), seed=st.integers(0, 2**31 - 1),
       scale=st.sampled_from([0.5, 3.0, 12.0]))
def test_property_matches_float64(n, lead, dtype, approximate, off, seed, scale):
    """Generated sizes, shapes, dtypes, both approximations, misaligned views and input scales (the
    tails): forward and backward within the file's tolerances of float64."""
    shape = (*lead, n)
    x = randn(*shape, dtype=dtype, scale=scale, seed=seed)
    dout = randn(*shape, dtype=dtype, seed=seed + 1)
    if off:
        x = torch.empty(x.numel() + off, dtype=dtype, device="cuda")[off:].view(shape).copy_(x)
    check_against_reference(x, dout, dtype, approximate)


_ANY_DTYPE = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])


@settings(max_examples=150)
@given(shape=st.lists(st.one_of(st.integers(0, 9), st.sampled_from([2**20, 2**31])), min_size=0, max_size=4).map(tuple),
       dtype=_ANY_DTYPE, device=st.sampled_from(["cuda", "cpu"]),
       approximate=st.sampled_from(["tanh", "none", "erf", "exact", ""]))
@example(shape=(2**31, 2**31, 2**20), dtype=torch.float32, device="cuda", approximate="tanh")  # found
def test_checker_never_accepts_what_the_kernel_cannot_do(shape, dtype, device, approximate):
    """Generated proxies (0-D to 4-D, empty, past 2^31 and 2^50 elements) and `approximate` values:
    whatever the checker accepts, gelu_forward / gelu_backward take it (CUDA, float dtype, approximate
    "tanh" or "none", a pack grid of numel / (16 / itemsize) / (2 * 256) + 1 <= 2^31 - 1 blocks) and it
    is not empty. Fails if a rule goes: without the grid rule a 2^31 x 2^31 x 2^20 input was accepted and
    gelu_forward would raise "too many elements"."""
    with tracectx(TraceCtx()):
        a = proxy(shape, dtype=dtype, device=device)
        if ge._checker(a, approximate=approximate) is not None:
            return
    assert device == "cuda" and dtype in (torch.float32, torch.bfloat16, torch.float16)
    assert approximate in ("tanh", "none")
    n = math.prod(shape)
    assert n > 0
    assert n // (16 // dtype.itemsize) // (2 * 256) + 1 <= 2**31 - 1
