"""layernorm: launchers against a float64 reference (forward, dx, dweight, dbias), every layout and
instantiation the launchers pick, determinism, CUDA graphs, and the Thunder claim.

CPU tests: the checker's decline reasons, the fallback to torch on CPU tensors, and the Thunder
plumbing (metas, grad transform) with the launchers swapped for a torch reference.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import thunder
from hypothesis import given, settings
from hypothesis import strategies as st
from thunder.core.trace import TraceCtx, tracectx

import conftest
import kforge
from conftest import DTYPES, REL_TOL, assert_close, gpu, proxy, randn, swap_launchers
from kforge import _thunder
from kforge._testing import override
from kforge.ops import layernorm as ln

EPS = 1e-5
AFFINE = ["weight+bias", "weight", "bias", "none"]


def make_inputs(shape, dtype, affine="weight+bias", device="cuda"):
    """x with a non-zero mean (exercises the two-pass variance), weight near 1, small bias, dout."""
    c = shape[-1]
    x = (randn(*shape, device=device) * 2 + 0.3).to(dtype)
    w = (1 + 0.5 * randn(c, device=device)).to(dtype) if "weight" in affine else None
    b = (0.5 * randn(c, device=device)).to(dtype) if "bias" in affine else None
    dout = randn(*shape, dtype=dtype, device=device)
    return x, w, b, dout


def reference(x, w, b, dout):
    """float64 forward output, mean, rstd and gradients from the same (rounded) inputs."""
    c = x.shape[-1]
    x64 = x.detach().double().requires_grad_(True)
    w64 = None if w is None else w.detach().double().requires_grad_(True)
    b64 = None if b is None else b.detach().double().requires_grad_(True)
    out = F.layer_norm(x64, (c,), w64, b64, EPS)
    out.backward(dout.double())
    rows = x64.detach().reshape(-1, c)
    mean = rows.mean(-1)
    rstd = (rows.var(-1, unbiased=False) + EPS).rsqrt()
    grad = lambda t: None if t is None else t.grad  # noqa: E731
    return out.detach(), mean, rstd, x64.grad, grad(w64), grad(b64)


def ln_forward(x, w, b, eps=EPS, *, variant=0, max_warps=0):
    """kforge._C.layernorm_forward under the launcher's testing override (variant 1: never GROUP;
    max_warps: fewer resident warps per SM)."""
    with override("layernorm_forward", variant=variant, max_warps=max_warps):
        return kforge._C.layernorm_forward(x, w, b, eps)


def ln_backward(dout, x, w, b, mean, rstd, *, variant=0, max_warps=0):
    """kforge._C.layernorm_backward under the testing override (variant 1: never RING / GROUP)."""
    with override("layernorm_backward", variant=variant, max_warps=max_warps):
        return kforge._C.layernorm_backward(dout, x, w, b, mean, rstd)


def check_against_reference(x, w, b, dout, dtype, variant=0):
    out, mean, rstd = ln_forward(x, w, b, EPS, variant=variant)
    dx, dw, db = ln_backward(dout, x, w, b, mean, rstd, variant=variant)
    r_out, r_mean, r_rstd, r_dx, r_dw, r_db = reference(x, w, b, dout)
    n = x.numel() // x.shape[-1]
    assert out.dtype == dtype and mean.dtype == rstd.dtype == torch.float32
    assert mean.shape == rstd.shape == (n,)
    assert_close(out, r_out, dtype, "out")
    # The stats are fp32 whatever the input dtype.
    assert_close(mean, r_mean, torch.float32, "mean")
    assert_close(rstd, r_rstd, torch.float32, "rstd")
    # dx = rstd (g - mean(g) - x_hat mean(g x_hat)), g = dout * w: over a few columns the terms
    # cancel, so its error is relative to them (see assert_close).
    g = dout.double() * (1.0 if w is None else w.double())
    assert_close(dx, r_dx, dtype, "dx", scale=(g * r_rstd.reshape(*x.shape[:-1], 1)).norm().item())
    assert (dw is None) == (w is None) and (db is None) == (b is None)
    if w is not None:
        assert dw.dtype == w.dtype
        assert_close(dw, r_dw, dtype, "dweight")
    if b is not None:
        assert db.dtype == b.dtype
        assert_close(db, r_db, dtype, "dbias")


# Shapes pick every layout and instantiation the launchers reach (threads per row tpr = 32 NW;
# units: 16-byte where C is a multiple of the pack and the pointers are aligned, else scalars).
# Forward, fp32 GROUP (a row over 32 NW threads, 8 columns a thread; C <= 1024): NW 1 at 100 / 128 /
#   256 (128: half the threads idle), 2 at 300 (threads with one of two units) / 384 / 512, 3 at 640
#   (partial warp) / 768, 4 at 1000 / 1024; scalar (8 elements a thread) at 3 (NW 1) and 771 (4).
# Forward, bf16 / half WARP (one warp per row), 16-byte units per lane P: 128 / 256 / 384 / 512: P=2
#   (64 rows of 128: the last chunk of 3 rows partial; 33 rows: odd N); 640 / 768: 3; 1000 / 1024:
#   4; 1536: 6; 1600 (partial) / 2048: 8; scalar P=32: 3, 100, 300, 771 (C % 8 != 0).
# Backward, bf16 / half RING (C <= 1024 with 16-byte units; thread t owns unit t, G groups a block,
#   the N rows split into contiguous ranges of q or q + 1 rows per group): NW 1 at 128 / 256 (one
#   warp a row: shuffles only), 2 at 384 / 512, 3 at 640 (partial warp) / 768, 4 at 1000 / 1024;
#   (8192, 768): 7 or 8 rows a group, 4 slots refilled; (20000, 768): the ring wraps many times;
#   (1, 768), (8, 768), (2, 5, 768): fewer rows than SMs (one group a block, one row a group).
# Backward, GROUP (C <= 1024 otherwise): fp32 16-byte units at the fp32 forward's shapes; scalars
#   (every dtype) at 3, 771, and bf16 100 / 300.
# BLOCK (longer rows: past 1024 columns, the bf16 / half forward with 16-byte units past 2048):
#   FITS (row slice in registers, C <= 4096): 16-byte 1536, 1600, 2048, 4096; scalar 2050. Re-read:
#   16-byte 4100 (fp32), 5120, 20000; scalar 4099, 4100 (bf16). (300, 4100) / (300, 4096): several
#   row groups per block in the backward.
# Groups / warps looping over more rows than they number (the last round partial): (8192, 768),
# (20000, 768), (4096, 1024), (2000, 771), (3000, 256), (3000, 100).
# Parameter-gradient reduce: 16-byte loads for even C, scalar for odd C (3, 771, 4099).
# N=1 and 3-D inputs too. AFFINE covers dweight and dbias together, alone, and neither (the
# backward then keeps no column sums at all).
SHAPES = [(8, 768), (1, 768), (2, 5, 768), (16, 1000), (1000, 771), (7, 3), (3, 4100), (300, 4100),
          (2, 4099), (4, 20000), (8192, 768), (64, 128), (33, 256), (40, 300), (33, 384), (48, 512),
          (20, 640), (4096, 1024), (5, 100), (24, 1536), (12, 2048), (10, 1600), (3000, 256),
          (3000, 100), (2000, 771), (20000, 768), (16, 4096), (300, 4096), (100, 1600), (50, 2050),
          (6, 5120)]
# The launchers' testing `variant` 1 (ln_forward / ln_backward; never GROUP / RING): rows of <= 1024
# columns take the WARP layout the default uses only past 2^30 rows (one warp per row; rows a warp
# takes at once R, persistent warps looping when the chunks outnumber them). Forward fp32 16-byte
# units per lane P: 2 at 100 / 128 / 256, 3 at 300 / 384, 4 at 512, 6 at 640 / 768, 8 at 1000 /
# 1024; scalar P=32 at 3 / 771. Backward: fp32 as the forward; bf16 16-byte P=2 at 128 / 256 / 384 /
# 512, 3 at 640 / 768, 4 at 1000 / 1024; scalar at 3 / 100 / 300 / 771. Warps looping over more
# chunks than they number: (8192, 768), (20000, 768), in the backward also (4096, 1024), (2000,
# 771); one row: (1, 768). Longer rows take the same kernels under both variants, so they run under
# variant 0 only.
WARP_SHAPES = [(1, 768), (16, 1000), (1000, 771), (7, 3), (8192, 768), (64, 128), (33, 256),
               (40, 300), (33, 384), (48, 512), (20, 640), (4096, 1024), (5, 100), (2000, 771),
               (20000, 768)]
VARIANT_SHAPES = [(s, 0) for s in SHAPES] + [(s, 1) for s in WARP_SHAPES]


def shape_variant_id(sv):
    shape, variant = sv
    return "x".join(map(str, shape)) + f"-v{variant}"


@gpu
@pytest.mark.parametrize("affine", AFFINE)
@pytest.mark.parametrize("shape_variant", VARIANT_SHAPES, ids=shape_variant_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_reference(dtype, shape_variant, affine):
    shape, variant = shape_variant
    check_against_reference(*make_inputs(shape, dtype, affine), dtype, variant)


# float16 has its own instantiations: one shape per layout and units per lane (WARP P=2, 3, 4, 6,
# 8 and scalar; RING at NW 1, 2, 3, 4 and rows < grid; GROUP scalar; BLOCK FITS / re-read, 16-byte /
# scalar). Variant 1 on the rows of <= 1024 columns: the WARP backward at P=2 (256, 512), 3 (640,
# 768), 4 (1024) and scalar (771).
F16_SHAPES = [(64, 768), (1, 768), (33, 771), (48, 512), (40, 256), (20, 640), (300, 1024),
              (24, 1536), (12, 2048), (50, 2050), (16, 4096), (3, 4100), (6, 5120)]


@gpu
@pytest.mark.parametrize("shape_variant", [(s, 0) for s in F16_SHAPES]
                         + [(s, 1) for s in F16_SHAPES if s[-1] <= 1024], ids=shape_variant_id)
def test_float16(shape_variant):
    shape, variant = shape_variant
    check_against_reference(*make_inputs(shape, torch.float16), torch.float16, variant)


@gpu
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("c", [512, 768, 771, 1024, 2048])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_rows_with_a_large_mean(dtype, c, aligned):
    """|mean| = 600 std: the statistics are taken around the mean, not as E[x^2] - mean^2 (whose
    fp32 cancellation would cost rstd errors of the order of a percent here). Covers the forward's
    one-butterfly merge (every lane of the warp holding as many elements: 512 / 768 / 1024 / 2048
    in 16-bit, 1024 unaligned in the scalar kernels) and its two-pass path (771, 768 unaligned)."""
    n = 257
    x = (randn(n, c, device="cuda") * 0.5 + 300.0).to(dtype)
    if not aligned:
        x = torch.empty(n * c + 1, dtype=dtype, device="cuda")[1:].view(n, c).copy_(x)
        assert x.data_ptr() % 16 != 0
    w = (1 + 0.5 * randn(c, device="cuda")).to(dtype)
    b = (0.5 * randn(c, device="cuda")).to(dtype)
    x64 = x.double()
    r_out = F.layer_norm(x64, (c,), w.double(), b.double(), EPS)
    r_rstd = (x64.var(-1, unbiased=False) + EPS).rsqrt()
    for variant in (0, 1):
        out, mean, rstd = ln_forward(x, w, b, EPS, variant=variant)
        assert ((rstd.double() - r_rstd).abs() / r_rstd).max().item() < 2e-5, variant
        assert ((mean.double() - x64.mean(-1)).abs().max() / 300.0).item() < 1e-6, variant
        # x - mean in fp32 is good to about ulp(300) / std = 6e-5 of the normalised value: that,
        # rather than the dtype's usual tolerance, bounds fp32 outputs here (torch's too).
        assert_close(out, r_out, dtype, "out", tol=max(REL_TOL[dtype], 2e-4))


@gpu
@pytest.mark.parametrize("variant", [0, 1], ids=lambda v: f"v{v}")
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_misaligned_and_strided_inputs(dtype, variant):
    """Views 2 / 4 bytes off a 16-byte boundary take the scalar path (variant 1: the scalar WARP
    kernels); strided views are copied."""
    n, c = 64, 768
    x, w, b, dout = make_inputs((n, c), dtype)
    x_off = torch.empty(n * c + 1, dtype=dtype, device="cuda")[1:].view(n, c).copy_(x)
    w_off = torch.empty(c + 1, dtype=dtype, device="cuda")[1:].copy_(w)
    assert x_off.data_ptr() % 16 != 0 and w_off.data_ptr() % 16 != 0
    check_against_reference(x_off, w, b, dout, dtype, variant)
    check_against_reference(x, w_off, b, dout, dtype, variant)
    x_t = x.t().contiguous().t()  # same values, column-major
    check_against_reference(x_t, w, b, dout.t().contiguous().t(), dtype, variant)


@gpu
@pytest.mark.parametrize("shape,dtype", [((8192, 768), torch.float32), ((8192, 768), torch.bfloat16),
                                         ((8192, 768), torch.float16), ((2000, 771), torch.bfloat16),
                                         ((4096, 4100), torch.float32), ((1000, 4096), torch.bfloat16)],
                         ids=str)
def test_backward_is_deterministic(shape, dtype):
    x, w, b, dout = make_inputs(shape, dtype)
    _, mean, rstd = kforge._C.layernorm_forward(x, w, b, EPS)
    first = kforge._C.layernorm_backward(dout, x, w, b, mean, rstd)
    for _ in range(3):
        again = kforge._C.layernorm_backward(dout, x, w, b, mean, rstd)
        for a, r in zip(first, again):
            assert torch.equal(a, r)


@gpu
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_max_warps_knob(dtype):
    """max_warps (A/B timing) only changes how many warps share the rows: per-row results are the
    same bits, the parameter gradients are sums in another grouping (same tolerance)."""
    x, w, b, dout = make_inputs((8192, 768), dtype)
    out, mean, rstd = kforge._C.layernorm_forward(x, w, b, EPS)
    grads = kforge._C.layernorm_backward(dout, x, w, b, mean, rstd)
    *_, r_dw, r_db = reference(x, w, b, dout)
    for mw in (2, 4, 8, 12):
        again = ln_forward(x, w, b, EPS, max_warps=mw)
        for a, r in zip(again, (out, mean, rstd)):
            assert torch.equal(a, r)
        dx, dw, db = ln_backward(dout, x, w, b, mean, rstd, max_warps=mw)
        assert torch.equal(dx, grads[0])
        assert_close(dw, r_dw, dtype, "dweight")
        assert_close(db, r_db, dtype, "dbias")
    with pytest.raises(kforge.KforgeError, match="max_warps must be >= 0"):
        ln_forward(x, w, b, EPS, max_warps=-1)


@gpu
@pytest.mark.parametrize("shape_variant", [((512, 768), 0), ((512, 771), 0), ((64, 4096), 0),
                                           ((512, 768), 1), ((512, 771), 1)], ids=shape_variant_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_graph_capture_of_backward(dtype, shape_variant):
    """The backward allocates its partial-sum scratch from PyTorch's allocator: capturable, warm-up
    on a side stream included (768: RING for bf16 / GROUP for fp32, and the dependent 16-byte
    reduce; 771: GROUP scalar and the scalar reduce; 4096: BLOCK; variant 1: WARP at 768 / 771)."""
    shape, variant = shape_variant
    x, w, b, dout = make_inputs(shape, dtype)
    _, mean, rstd = ln_forward(x, w, b, EPS, variant=variant)
    expected = ln_backward(dout, x, w, b, mean, rstd, variant=variant)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (compile, load) outside the capture
        ln_backward(dout, x, w, b, mean, rstd, variant=variant)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ln_backward(dout, x, w, b, mean, rstd, variant=variant)
    graph.replay()
    torch.cuda.synchronize()
    for a, r in zip(captured, expected):
        assert torch.equal(a, r)


@gpu
def test_launcher_rejects_bad_arguments():
    x, w, b, dout = make_inputs((4, 8), torch.float32)
    with pytest.raises(kforge.KforgeError, match="weight must have shape"):
        kforge._C.layernorm_forward(x, torch.ones(9, device="cuda"), b, EPS)
    with pytest.raises(kforge.KforgeError, match="bias has dtype"):
        kforge._C.layernorm_forward(x, w, b.to(torch.bfloat16), EPS)
    _, mean, rstd = kforge._C.layernorm_forward(x, w, b, EPS)
    with pytest.raises(kforge.KforgeError, match="mean must be float32"):
        kforge._C.layernorm_backward(dout, x, w, b, mean.double(), rstd)
    with pytest.raises(kforge.KforgeError, match="dout has shape"):
        kforge._C.layernorm_backward(dout[:2], x, w, b, mean, rstd)
    with pytest.raises(kforge.KforgeError, match="variant must be in"):
        ln_forward(x, w, b, EPS, variant=2)
    with pytest.raises(kforge.KforgeError, match="variant must be in"):
        ln_backward(dout, x, w, b, mean, rstd, variant=-1)


# ---- a 16-bit y of fp32 x (autocast's residual stream; kforge.fusion.norm_epilogues) ------------------
NARROW = {torch.bfloat16: "bf16", torch.float16: "half"}


@gpu
@pytest.mark.parametrize("y_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("affine", ["weight+bias", "none"])
@pytest.mark.parametrize("shape", [(8192, 768), (37, 1024), (3, 5, 100), (17, 6), (1, 1), (1000, 64), (9, 7)],
                         ids=lambda s: "x".join(map(str, s)))
def test_forward_stores_a_narrow_y(shape, affine, y_dtype):
    """layernorm_forward(fp32 x, y_dtype=bf16 / fp16): out is bit for bit the fp32 kernel's out
    converted by torch (one rounding of the same fp32 value), mean and rstd the same, from the GROUP
    kernel itself (8-byte stores where C % 4 == 0, element-wise ones otherwise); within the 16-bit
    type's rounding of float64. Outputs are poisoned first: every element is written."""
    x, w, b, dout = make_inputs(shape, torch.float32, affine)
    out, mean, rstd = kforge._C.layernorm_forward(x, w, b, EPS, y_dtype=y_dtype)
    out32, mean32, rstd32 = kforge._C.layernorm_forward(x, w, b, EPS)
    assert out.dtype == y_dtype and out.shape == x.shape and out.is_contiguous()
    assert torch.equal(out, out32.to(y_dtype)) and torch.equal(mean, mean32) and torch.equal(rstd, rstd32)
    assert_close(out, reference(x, w, b, dout)[0].to(y_dtype), y_dtype, "narrow out")
    vec = "true" if shape[-1] % 4 == 0 else "false"
    expr = f"layernorm_forward_group_kernel<float, {vec}, {NARROW[y_dtype]}>"
    assert expr in conftest.launched("layernorm"), sorted(conftest.launched("layernorm"))


@gpu
@pytest.mark.parametrize("case", ["no-group", "long-row", "misaligned", "empty"])
def test_forward_narrow_y_elsewhere_and_bad_requests(case):
    """Where the GROUP kernel does not run (the WARP fallback, rows over 1024 columns) the fp32 result
    is converted: the same bits as that layout's fp32 out; a misaligned x takes the element-wise GROUP
    kernel; no rows: an empty 16-bit out (nothing planned: a plan for 0 rows divides by 0). y_dtype
    for a 16-bit x or a float64 y is refused naming the op."""
    shape = {"no-group": (65, 768), "long-row": (33, 1600), "misaligned": (65, 768), "empty": (0, 768)}[case]
    x, w, b, _ = make_inputs(shape, torch.float32)
    if case == "misaligned":
        x = torch.cat([torch.zeros(1, device="cuda"), x.flatten()])[1:].view(shape)  # 4-byte offset
    variant = 1 if case == "no-group" else 0
    with override("layernorm_forward", variant=variant):  # the fp32 result of the same kernel and layout
        out, mean, rstd = kforge._C.layernorm_forward(x, w, b, EPS, y_dtype=torch.bfloat16)
        out32, mean32, rstd32 = kforge._C.layernorm_forward(x, w, b, EPS)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.equal(out, out32.bfloat16()) and torch.equal(mean, mean32) and torch.equal(rstd, rstd32)
    with pytest.raises(kforge.KforgeError, match="layernorm_forward.*only float32 x"):
        kforge._C.layernorm_forward(x.bfloat16(), None, None, EPS, y_dtype=torch.float16)
    with pytest.raises(kforge.KforgeError, match="layernorm_forward.*only float32 x"):
        kforge._C.layernorm_forward(x, w, b, EPS, y_dtype=torch.float64)
    assert kforge._C.layernorm_forward(x, w, b, EPS, y_dtype=torch.float32)[0].dtype == torch.float32


@gpu
@pytest.mark.parametrize("copy", [None, torch.bfloat16, torch.float16], ids=["no-copy", "bf16", "fp16"])
@pytest.mark.parametrize("res", [True, False], ids=["dres", "no-dres"])
@pytest.mark.parametrize("shape", [(8192, 768), (37, 1024), (3, 5, 100), (17, 6), (33, 1600), (1, 4)],
                         ids=lambda s: "x".join(map(str, s)))
def test_backward_adds_dresidual_and_stores_a_copy(shape, res, copy):
    """layernorm_backward(..., dresidual) and layernorm_backward_copy (fp32 x): dx is bit for bit the
    plain kernel's dx + dres (one fp32 add, as the separate add), the copy bit for bit its conversion,
    dweight / dbias unchanged; the 16-byte GROUP kernel does both itself (C % 4 == 0 up to 1024
    columns), other rows get torch's add and conversion (outputs poisoned: conftest)."""
    if not res and copy is None:
        pytest.skip("the plain backward: tested above")
    x, w, b, dout = make_inputs(shape, torch.float32)
    dres = randn(*shape, seed=11) if res else None
    _, mean, rstd = kforge._C.layernorm_forward(x, w, b, EPS)
    dx0, dw0, db0 = kforge._C.layernorm_backward(dout, x, w, b, mean, rstd)
    want = dx0 + dres if res else dx0
    if copy is None:
        dx, dw, db = kforge._C.layernorm_backward(dout, x, w, b, mean, rstd, dres)
    else:
        dx, dw, db, z = kforge._C.layernorm_backward_copy(dout, x, w, b, mean, rstd, dres, copy)
        assert z.dtype == copy and z.shape == x.shape and torch.equal(z, want.to(copy))
    assert torch.equal(dx, want) and torch.equal(dw, dw0) and torch.equal(db, db0)
    if shape[-1] % 4 == 0 and shape[-1] <= 1024:
        nz = {None: 0, torch.bfloat16: 1, torch.float16: 2}[copy]
        expr = f"layernorm_backward_group_kernel<float, true, {str(res).lower()}, {nz}>"
        assert expr in conftest.launched("layernorm"), sorted(conftest.launched("layernorm"))


TYPE_NAME = {torch.float32: "float", torch.bfloat16: "bf16", torch.float16: "half"}


@gpu
@pytest.mark.parametrize("y_dtype", [None, torch.bfloat16, torch.float16], ids=["y-fp32", "y-bf16", "y-fp16"])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(8192, 768), (37, 1024), (3, 5, 100), (17, 6), (33, 1600), (1, 4), (0, 8)],
                         ids=lambda s: "x".join(map(str, s)))
def test_add_forward_adds_the_branch_then_normalises(shape, x_dtype, y_dtype):
    """add_layernorm_forward(16-bit x, fp32 residual): s is bit for bit float(x) + residual (eager's
    upcast and add), and y, mean, rstd are bit for bit layernorm_forward's of that s (y_dtype as
    there); the 16-byte GROUP kernel does it in one pass, other rows add with torch first."""
    xb = (randn(*shape, seed=21) * 2).to(x_dtype)
    r, w, b, _ = make_inputs(shape, torch.float32)
    y, mean, rstd, s = kforge._C.add_layernorm_forward(xb, r, w, b, EPS, y_dtype=y_dtype)
    s_ref = r + xb.float()
    y_ref, mean_ref, rstd_ref = kforge._C.layernorm_forward(s_ref, w, b, EPS, y_dtype=y_dtype)
    assert s.dtype == torch.float32 and torch.equal(s, s_ref)
    assert y.dtype == (y_dtype or torch.float32) and torch.equal(y, y_ref)
    assert torch.equal(mean, mean_ref) and torch.equal(rstd, rstd_ref)
    if shape[-1] % 4 == 0 and 0 < shape[-1] <= 1024 and shape[0] > 0:
        expr = (f"layernorm_forward_group_kernel<float, true, {TYPE_NAME[y_dtype or torch.float32]}, "
                f"{TYPE_NAME[x_dtype]}>")
        assert expr in conftest.launched("layernorm"), sorted(conftest.launched("layernorm"))


@gpu
def test_add_forward_fallback_and_bad_requests():
    """Without the GROUP layout (the testing override's WARP fallback) the same bits; a 32-bit x, a
    16-bit residual, different sizes or a float64 y are refused naming the op."""
    xb = randn(65, 768, seed=22).bfloat16()
    r, w, b, _ = make_inputs((65, 768), torch.float32)
    with override("layernorm_forward", variant=1):
        y, mean, rstd, s = kforge._C.add_layernorm_forward(xb, r, w, b, EPS, y_dtype=torch.bfloat16)
        y_ref, mean_ref, rstd_ref = kforge._C.layernorm_forward(r + xb.float(), w, b, EPS, y_dtype=torch.bfloat16)
    assert torch.equal(s, r + xb.float()) and torch.equal(y, y_ref) and torch.equal(mean, mean_ref)
    for args, match in (((r, r), "a bfloat16 / float16 x added to a float32 residual"),
                        ((xb, r.bfloat16()), "a bfloat16 / float16 x added to a float32 residual"),
                        ((xb[:64], r), "residual and x sizes differ")):
        with pytest.raises(kforge.KforgeError, match="add_layernorm_forward.*" + match):
            kforge._C.add_layernorm_forward(*args, w, b, EPS)
    with pytest.raises(kforge.KforgeError, match="add_layernorm_forward: y_dtype"):
        kforge._C.add_layernorm_forward(xb, r, w, b, EPS, y_dtype=torch.float64)


def test_gpt2_autocast_branch_adds_in_the_norms():
    """The fake-traced nanoGPT under autocast: every LayerNorm whose input is the fp32 stream plus a
    bf16 branch (all but the first layer's first: its input is the embeddings' sum) adds the branch
    itself (kforge_add_layernorm_forward) and stores bf16; no forward region adds a branch to the
    stream."""
    from kforge.zoo import nanogpt

    ft = conftest.fake_cuda_trace(nanogpt.make, jit=kforge.jit, size="tiny", batch=2, seq=16, autocast=True)
    n_layers = sum(1 for b in ft.backward.bound_symbols if b.sym.name == "kforge_attention_backward")
    adds = [b for b in ft.forward.bound_symbols if b.sym.name == "kforge_add_layernorm_forward"]
    plain = [b for b in ft.forward.bound_symbols if b.sym.name == "kforge_layernorm_forward"]
    assert len(adds) == 2 * n_layers and len(plain) == 1, ([str(b) for b in adds], [str(b) for b in plain])
    for b in adds:
        x, residual = b.args[:2]
        assert x.dtype == thunder.dtypes.bfloat16 and residual.dtype == thunder.dtypes.float32, str(b)
        assert b.args[5] == torch.bfloat16 and b.output[0].dtype == thunder.dtypes.bfloat16, str(b)
        assert b.output[3].dtype == thunder.dtypes.float32, str(b)
    for b in ft.forward.bound_symbols:
        if b.sym.name.startswith("kforgeFusion"):
            assert not {"add"} <= {s.sym.name for s in b.subsymbols} or not any(
                p.dtype == thunder.dtypes.bfloat16 for p in b.flat_proxy_args), str(b)


def test_gpt2_autocast_norm_backwards_add_and_copy():
    """The fake-traced nanoGPT under autocast: every LayerNorm backward but the last norm's adds the
    residual stream's gradient itself (fold_residual_grads), every one whose dx a bf16 matmul reads
    stores that copy (copy_norm_grads): no fusion region reads a norm backward's dx."""
    from kforge.zoo import nanogpt

    ft = conftest.fake_cuda_trace(nanogpt.make, jit=kforge.jit, size="tiny", batch=2, seq=16, autocast=True)
    names = ("kforge_layernorm_backward", "kforge_layernorm_backward_copy")
    bwd = [b for b in ft.backward.bound_symbols if b.sym.name in names]
    n_layers = sum(1 for b in ft.backward.bound_symbols if b.sym.name == "kforge_attention_backward")
    assert len(bwd) == 2 * n_layers + 1, [str(b) for b in bwd]
    with_dres = [b for b in bwd if len(b.args) > 6 and b.args[6] is not None]
    assert len(with_dres) == 2 * n_layers, [str(b) for b in bwd]  # all but ln_f's
    copies = [b for b in bwd if b.sym.name == names[1]]
    # the first layer's attention norm's dx goes to the embeddings (fp32), not to a bf16 matmul
    assert len(copies) == 2 * n_layers, [str(b) for b in bwd]
    for b in copies:
        assert b.args[7] == torch.bfloat16 and b.output[3].dtype == thunder.dtypes.bfloat16
    # a region may still read a dx (the position embedding's gradient sums the first norm's over the
    # batch) but neither adds to it nor converts it to bf16
    dxs = {b.output[0].name: b.output[0] for b in bwd}
    for b in ft.backward.bound_symbols:
        read = [dxs[p.name] for p in b.flat_proxy_args if p.name in dxs]
        if b.sym.name.startswith("kforgeFusion") and read:
            assert not any(s.sym.name == "add" for s in b.subsymbols), str(b)
            assert not any(o.dtype == thunder.dtypes.bfloat16 and tuple(o.shape) == tuple(read[0].shape)
                           for o in b.flat_outs), str(b)


def test_gpt2_bf16_norms_are_left_alone():
    """Near miss: a bf16 nanoGPT (no autocast: the stream, the norms and the matmuls all bf16) has no
    conversion to fold and no fp32 stream: plain LayerNorm calls, no y_dtype, no dresidual, no copy."""
    from kforge.zoo import nanogpt

    ft = conftest.fake_cuda_trace(nanogpt.make, jit=kforge.jit, size="tiny", batch=2, seq=16, dtype=torch.bfloat16)
    fwd = [b for b in ft.forward.bound_symbols if b.sym.name == "kforge_layernorm_forward"]
    bwd = [b for b in ft.backward.bound_symbols if "layernorm" in b.sym.name]
    assert fwd and all(len(b.args) < 5 or b.args[4] is None for b in fwd), [str(b) for b in fwd]
    assert bwd and all(b.sym.name == "kforge_layernorm_backward" and (len(b.args) < 7 or b.args[6] is None)
                       for b in bwd), [str(b) for b in bwd]


def test_gpt2_autocast_norms_store_bf16_themselves():
    """The fake-traced nanoGPT under autocast (kforge.jit): every LayerNorm of the fp32 residual stream
    stores bf16 itself (its only reader was autocast's cast for the next matmul), and no fusion region
    reads a norm's output."""
    from kforge.zoo import nanogpt

    ft = conftest.fake_cuda_trace(nanogpt.make, jit=kforge.jit, size="tiny", batch=2, seq=16, autocast=True)
    y_dtype = {"kforge_layernorm_forward": 4, "kforge_add_layernorm_forward": 5}  # its argument's place
    norms = [b for b in ft.forward.bound_symbols if b.sym.name in y_dtype]
    n_layers = sum(1 for b in ft.backward.bound_symbols if b.sym.name == "kforge_attention_backward")
    assert len(norms) == 2 * n_layers + 1 and n_layers > 0, [str(b) for b in norms]
    for b in norms:
        stream = b.args[0] if b.sym.name == "kforge_layernorm_forward" else b.args[1]
        assert stream.dtype == thunder.dtypes.float32 and b.args[y_dtype[b.sym.name]] == torch.bfloat16, str(b)
        assert b.output[0].dtype == thunder.dtypes.bfloat16 and b.output[1].dtype == thunder.dtypes.float32
    outs = {b.output[0].name for b in norms}
    for b in ft.forward.bound_symbols:
        if b.sym.name.startswith("kforgeFusion"):
            assert not outs & {p.name for p in b.flat_proxy_args}, str(b)


@gpu
@pytest.mark.parametrize("affine", ["weight+bias", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_thunder_jit_uses_kforge(dtype, affine):
    shape = (4, 33, 768)
    x, w, b, dout = make_inputs(shape, dtype, affine)
    params = [t for t in (w, b) if t is not None]
    for t in (x, *params):
        t.requires_grad_(True)

    def fn(x, w, b):
        return F.layer_norm(x, (shape[-1],), w, b, EPS)

    jfn = thunder.jit(fn, executors=[kforge.executor])
    out = jfn(x, w, b)
    grads = torch.autograd.grad(out, (x, *params), dout)
    assert "kforge_layernorm_forward" in str(thunder.last_traces(jfn)[-1])
    assert "kforge_layernorm_backward" in str(thunder.last_backward_traces(jfn)[-1])
    r_out, _, _, r_dx, r_dw, r_db = reference(x, w, b, dout)
    assert_close(out, r_out, dtype, "out")
    for g, r, what in zip(grads, [r_dx] + [r for r in (r_dw, r_db) if r is not None], ["dx", "dw", "db"]):
        assert_close(g, r, dtype, what)
    # Eager torch agrees too (same tolerance against float64).
    assert_close(fn(x, w, b).detach(), r_out, dtype, "eager out")

    with torch.no_grad():  # inference: the execution transform (forward kernel only)
        jinf = thunder.jit(fn, executors=[kforge.executor])
        assert_close(jinf(x, w, b), r_out, dtype, "inference out")
        assert "kforge_layernorm_forward" in str(thunder.last_traces(jinf)[-1])


@gpu
def test_thunder_leaves_multi_dim_normalized_shape_to_torch():
    x, _, _, _ = make_inputs((8, 4, 64), torch.float32)
    w, b = 1 + 0.5 * randn(4, 64), 0.5 * randn(4, 64)
    _thunder.reset_declines()
    jfn = thunder.jit(lambda x, w, b: F.layer_norm(x, (4, 64), w, b), executors=[kforge.executor])
    out = jfn(x, w, b)
    assert "kforge_layernorm" not in str(thunder.last_traces(jfn)[-1])
    assert any("spans 2 dims" in r for r in _thunder.declines()["layer_norm"])
    assert_close(out, F.layer_norm(x.double(), (4, 64), w.double(), b.double()), torch.float32, "torch")


# ---- CPU: declines, fallback, plumbing ----------------------------------------------------------------
def test_cpu_tensors_fall_back_to_torch():
    _thunder.reset_declines()
    x, w, b, dout = make_inputs((3, 7, 16), torch.float32, device="cpu")
    for t in (x, w, b):
        t.requires_grad_(True)

    def fn(x, w, b):
        return F.layer_norm(x, (16,), w, b, EPS)

    jfn = thunder.jit(fn, executors=[kforge.executor])
    out = jfn(x, w, b)
    grads = torch.autograd.grad(out, (x, w, b), dout)
    assert "kforge_" not in str(thunder.last_traces(jfn)[-1])
    ref = fn(x, w, b)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, torch.autograd.grad(ref, (x, w, b), dout)):
        torch.testing.assert_close(g, r)
    reasons = _thunder.declines()["layer_norm"]
    assert any(r.startswith("layernorm: ") and "not CUDA" in r for r in reasons), reasons


def test_launchers_reject_cpu_tensors():
    x = randn(4, 8, device="cpu")
    with pytest.raises(kforge.KforgeError, match="layernorm_forward: x must be a CUDA tensor"):
        kforge._C.layernorm_forward(x, None, None, EPS)
    stats = torch.ones(4)
    with pytest.raises(kforge.KforgeError, match="layernorm_backward: x must be a CUDA tensor"):
        kforge._C.layernorm_backward(x, x, None, None, stats, stats)


def test_checker_accepts_and_declines_with_reasons():
    check = ln._checker
    with tracectx(TraceCtx()):
        a = proxy((8, 768))
        w, b = proxy((768,)), proxy((768,))
        assert check(a, (768,), w, b, EPS) is None
        assert check(a, (768,), None, None, EPS) is None
        assert check(a, [768], w, None) is None
        assert check(proxy((768,)), (768,), w, b) is None  # 1-D input: one row
        cases = {
            "not CUDA": check(proxy((8, 768), device="cpu"), (768,), None, None),
            "float64": check(proxy((8, 768), dtype=torch.float64), (768,), None, None),
            "spans 2 dims": check(proxy((8, 4, 192)), (4, 192), None, None),
            "does not match the last dim": check(a, (767,), None, None),
            "weight shape": check(a, (768,), proxy((2, 384)), None),
            "weight dtype": check(a, (768,), proxy((768,), dtype=torch.bfloat16), None),
            "bias is on": check(a, (768,), w, proxy((768,), device="cuda:1")),
            "empty": check(proxy((0, 768)), (768,), None, None),
            "0-D": check(proxy(()), (), None, None),
        }
    for expected, reason in cases.items():
        assert reason is not None and expected in reason, (expected, reason)


# Thunder plumbing without a GPU: the claim's metas and grad transform run for real; only the kforge
# launchers are swapped for a torch reference and the checker accepts CPU tensors.
def _ref_forward(x, w, b, eps, y_dtype=None):
    c = x.shape[-1]
    rows = x.float().reshape(-1, c)
    mean, rstd = rows.mean(-1), (rows.var(-1, unbiased=False) + eps).rsqrt()
    y = (rows - mean[:, None]) * rstd[:, None]
    y = y * w.float() if w is not None else y
    y = y + b.float() if b is not None else y
    return y.to(y_dtype or x.dtype).reshape(x.shape), mean, rstd


def _ref_backward(dout, x, w, b, mean, rstd, dresidual=None):
    c = x.shape[-1]
    rows, g = x.float().reshape(-1, c), dout.float().reshape(-1, c)
    xh = (rows - mean[:, None]) * rstd[:, None]
    gw = g * w.float() if w is not None else g
    dx = rstd[:, None] * (gw - gw.mean(-1, keepdim=True) - xh * (gw * xh).mean(-1, keepdim=True))
    dw = None if w is None else (g * xh).sum(0).to(w.dtype)
    db = None if b is None else g.sum(0).to(b.dtype)
    dx = dx.to(x.dtype).reshape(x.shape)
    return (dx if dresidual is None else dx + dresidual), dw, db


@pytest.fixture
def cpu_reference_launchers(monkeypatch):
    swap_launchers(monkeypatch, ln, {ln.layernorm_forward: _ref_forward, ln.layernorm_backward: _ref_backward})


@pytest.mark.parametrize("affine", AFFINE)
def test_thunder_plumbing_with_reference_launchers(cpu_reference_launchers, affine):
    x, w, b, dout = make_inputs((2, 3, 16), torch.float32, affine, device="cpu")
    params = [t for t in (x, w, b) if t is not None]
    for t in params:
        t.requires_grad_(True)

    def fn(x, w, b):
        return F.layer_norm(x, (16,), w, b, EPS)

    jfn = thunder.jit(fn, executors=[kforge.executor])
    out = jfn(x, w, b)
    grads = torch.autograd.grad(out, params, dout)
    fwd, bwd = str(thunder.last_traces(jfn)[-1]), str(thunder.last_backward_traces(jfn)[-1])
    assert "kforge_layernorm_forward" in fwd and "kforge_layernorm_backward" in bwd, (fwd, bwd)
    ref = fn(x, w, b)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, torch.autograd.grad(ref, params, dout)):
        torch.testing.assert_close(g, r)


# ---- property-based (hypothesis) ----------------------------------------------------------------
# Row lengths around the launcher's switch points (src/ops/layernorm.cpp): the GROUP / WARP / RING
# limit 1024, 16-bit WARP forward 2048, BLOCK FITS 4096 (scalar: 512 threads x 8), 16-byte units (C a
# multiple of 4 / 8) or scalars, and small odd rows.
_LN_C = st.one_of(st.integers(1, 40), st.sampled_from([128, 256, 512, 1024, 2048, 4096]).flatmap(
    lambda e: st.integers(e - 3, e + 3)))


@gpu
@pytest.mark.sanitize
@pytest.mark.sanitize_race
@settings(max_examples=30)
@given(C=_LN_C, rows=st.sampled_from([1, 3, 33, 200]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       affine=st.sampled_from(AFFINE), variant=st.sampled_from([0, 1]), eps=st.sampled_from([1e-5, 1e-3, 0.0]),
       seed=st.integers(0, 2**31 - 1), strided=st.booleans())
def test_property_matches_float64(C, rows, dtype, affine, variant, eps, seed, strided):
    """Generated rows, dtypes, affine parameters, layouts (variant), eps and strided inputs: forward
    (out, mean, rstd) and backward (dx, dweight, dbias) within the file's tolerances of float64."""
    x = (randn(rows, C, seed=seed) * 2 + 0.3).to(dtype)  # seeded: a failing example reproduces
    w = (1 + 0.5 * randn(C, seed=seed + 1)).to(dtype) if "weight" in affine else None
    b = (0.5 * randn(C, seed=seed + 2)).to(dtype) if "bias" in affine else None
    dout = randn(rows, C, dtype=dtype, seed=seed + 3)
    if strided:  # a view with padded rows: the launcher copies it; the reference reads the same values
        x = torch.empty(rows, C + 5, dtype=dtype, device="cuda")[:, :C].copy_(x)
    out, mean, rstd = ln_forward(x, w, b, eps, variant=variant)
    dx, dw, db = ln_backward(dout, x, w, b, mean, rstd, variant=variant)
    x64 = x.detach().double().requires_grad_(True)
    w64 = None if w is None else w.double().requires_grad_(True)
    b64 = None if b is None else b.double().requires_grad_(True)
    ref = F.layer_norm(x64, (C,), w64, b64, eps)
    ref.backward(dout.double())
    r_rstd = (x64.detach().var(-1, unbiased=False) + eps).rsqrt()
    if eps > 0 or C > 1:
        assert_close(out, ref.detach(), dtype, "out")
    else:  # 0 * inf: NaN, as torch's (x - mean) * rstd is
        assert out.isnan().all() and ref.isnan().all(), "out of one-element rows with eps = 0"
    assert_close(mean, x64.detach().mean(-1), torch.float32, "mean")
    if eps > 0 or C > 1:  # C = 1, eps = 0: rstd is inf (both sides), nothing to compare relatively
        assert_close(rstd, r_rstd, torch.float32, "rstd")
        g = dout.double() * (1.0 if w is None else w.double())
        scale = (g * r_rstd.unsqueeze(-1)).norm().item()
        if C == 1:  # exactly 0: what is left is the kernel's rounding of terms as large as g * rstd
            assert dx.double().norm().item() <= 1e-4 * scale, "dx of one-element rows"
        else:
            assert_close(dx, x64.grad, dtype, "dx", scale=scale)
        if w is not None:
            assert_close(dw, w64.grad, dtype, "dweight")
    if b is not None:
        assert_close(db, b64.grad, dtype, "dbias")


_ANY_DTYPE = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])


@settings(max_examples=150)
@given(shape=st.lists(st.one_of(st.integers(0, 9), st.sampled_from([2**30, 2**30 + 1])), min_size=0, max_size=3).map(tuple),
       dtype=_ANY_DTYPE, device=st.sampled_from(["cuda", "cpu"]), ns=st.integers(-1, 2),
       w=st.sampled_from(["none", "ok", "short", "2d", "dtype", "cpu"]), b=st.sampled_from(["none", "ok", "short"]),
       eps=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just("1e-5"), st.just(True)))
def test_checker_never_accepts_what_the_kernel_cannot_do(shape, dtype, device, ns, w, b, eps):
    """Generated proxies and arguments: whatever the checker accepts, the launcher's checks
    (layernorm_forward: CUDA, float dtype, >= 1 dim, C in [1, 2^30], weight / bias (C,) of x's dtype
    and device, eps >= 0) pass, and the normalised shape is the last dim. Fails if a rule goes
    (this found eps < 0: accepted, then the launcher raised)."""
    C = shape[-1] if shape else 1
    normalized = shape[len(shape) - ns:] if 0 < ns <= len(shape) else (C + 1,) if ns == -1 else ()

    def param(kind):
        return {"none": None, "ok": proxy(C, dtype=dtype, device=device), "short": proxy(C + 1, dtype=dtype, device=device),
                "2d": proxy(1, C, dtype=dtype, device=device), "dtype": proxy(C, dtype=torch.float64, device=device),
                "cpu": proxy(C, dtype=dtype, device="cpu")}[kind]

    with tracectx(TraceCtx()):
        a = proxy(shape, dtype=dtype, device=device)
        if ln._checker(a, normalized, param(w), param(b), eps) is None:
            assert device == "cuda" and dtype in (torch.float32, torch.bfloat16, torch.float16)
            assert len(shape) >= 1 and 1 <= C <= 2**30
            assert tuple(normalized) == (C,)
            assert w in ("none", "ok") and b in ("none", "ok")
            assert isinstance(eps, float) and eps >= 0


def test_checker_declines_negative_eps():
    with tracectx(TraceCtx()):
        assert "eps=-1e-05 is not a number >= 0" in ln._checker(proxy(4, 8), (8,), None, None, -1e-5)
        assert "is not a number" in ln._checker(proxy(4, 8), (8,), None, None, float("nan"))
        assert ln._checker(proxy(4, 8), (8,), None, None, 0.0) is None
