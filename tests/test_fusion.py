"""kforge.fusion: lowering, code generation, partitioning, and the generated kernels against torch.

CPU (CI): every case is traced by Thunder on CPU tensors, lowered to the IR and evaluated with the IR's
torch reference against eager PyTorch (the lowering's meaning); its source is generated for every
layout variant and compiled by NVRTC for sm_80 and sm_90; generated chains of prims (hypothesis) do
the same; the users' models are traced as on a GPU (fake tensors) and their regions checked.
GPU: the same cases and generated chains run through `thunder.jit` with the fusion executor against
eager PyTorch, on contiguous, transposed, broadcast, sliced (unaligned), size-1 and odd shapes, in
fp32 / bf16 / fp16, poisoned outputs; reductions of every schedule; > 2^31 elements; streams and CUDA
graphs.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close, gpu, randn, traced_region

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

DTYPES3 = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


# ---- the cases: torch functions whose traces are elementwise / view / reduction prims ------------------
def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _silu_mul(a, b):
    return F.silu(a) * b


def _gelu_erf(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _softplus_like(x, y):
    return torch.where(x > y, torch.log1p(torch.exp(-torch.abs(x))), torch.tanh(y) ** 2)


def _minmax(x, y):
    return torch.maximum(x, y) - torch.minimum(x, 0.5 * y), torch.clamp(x, -0.5, 0.75)


def _transpose_add(x, y):
    return x.transpose(-1, -2) + y


def _reshape_mul(x, y):
    b, t, c = x.shape
    return (x.reshape(b, t, 4, c // 4) * y).reshape(b, t, c)


def _pad_slice(x):
    return F.pad(x[..., 1:], (2, 1)) * 3.0


def _cat3(x, y, z):
    return torch.cat([x * 2, y, z.sin()], dim=1)


def _sum_last(x):
    return (x * x).sum(-1)


def _sum_lead(x, y):
    return (x * y).sum((0, 1))


def _mean_keepdim(x):
    return x.float().mean(-1, keepdim=True) * 2.0


def _amax_mid(x):
    return x.amax(1)


def _var_mean(x):
    v, m = torch.var_mean(x.float(), dim=-1, correction=1)
    return v + 1.0, m


def _rsqrt_norm_stats(x):
    return torch.rsqrt((x.float() ** 2).mean(-1) + 1e-5)


def _sum_all(x):
    return x.sum()


def _add_then_sum_of_view(x, y):
    # HF Conv1D's backward: the residual gradient goes on as (B, T, C), its bias gradient is the sum of
    # its (B * T, C) view: one region whose kept output has another shape than the reduction's input
    s = x + y
    return s, s.reshape(-1, s.shape[-1]).sum(0, keepdim=True)


def _masks_odd(x, y):
    # bool and int64 outputs whose odd width leaves one element per thread: 1-byte stores
    return x > y, (x * y > 0.25) & (y < 1.0), (x > 0).long() + 2


def _grad_like(dy, x):
    s = torch.sigmoid(x)
    return dy * s * (1 + x * (1 - s)), (dy * x).sum(0)


CASES: dict[str, tuple[Callable, Callable[[torch.dtype, str], tuple]]] = {
    "rope": (_rope, lambda dt, dev: (randn(2, 3, 16, 64, dtype=dt, device=dev), randn(16, 64, dtype=dt, device=dev),
                                     randn(16, 64, dtype=dt, device=dev))),
    "silu_mul": (_silu_mul, lambda dt, dev: (randn(3, 5, 96, dtype=dt, device=dev), randn(3, 5, 96, dtype=dt, device=dev))),
    "gelu_erf": (_gelu_erf, lambda dt, dev: (randn(7, 33, dtype=dt, device=dev),)),
    "softplus_like": (_softplus_like, lambda dt, dev: (randn(9, 17, dtype=dt, device=dev), randn(9, 17, dtype=dt, device=dev))),
    "minmax": (_minmax, lambda dt, dev: (randn(5, 8, dtype=dt, device=dev), randn(5, 8, dtype=dt, device=dev))),
    "transpose_add": (_transpose_add, lambda dt, dev: (randn(4, 6, 10, dtype=dt, device=dev), randn(4, 10, 6, dtype=dt, device=dev))),
    "reshape_mul": (_reshape_mul, lambda dt, dev: (randn(2, 5, 64, dtype=dt, device=dev), randn(2, 5, 4, 16, dtype=dt, device=dev))),
    "pad_slice": (_pad_slice, lambda dt, dev: (randn(3, 7, 12, dtype=dt, device=dev),)),
    "cat3": (_cat3, lambda dt, dev: (randn(2, 3, 8, dtype=dt, device=dev), randn(2, 5, 8, dtype=dt, device=dev),
                                     randn(2, 1, 8, dtype=dt, device=dev))),
    "sum_last": (_sum_last, lambda dt, dev: (randn(6, 5, 300, dtype=dt, device=dev),)),
    "sum_lead": (_sum_lead, lambda dt, dev: (randn(8, 33, 24, dtype=dt, device=dev), randn(8, 33, 24, dtype=dt, device=dev))),
    "mean_keepdim": (_mean_keepdim, lambda dt, dev: (randn(4, 7, 40, dtype=dt, device=dev),)),
    "amax_mid": (_amax_mid, lambda dt, dev: (randn(3, 11, 16, dtype=dt, device=dev),)),
    "var_mean": (_var_mean, lambda dt, dev: (randn(5, 129, dtype=dt, device=dev),)),
    "rms_stats": (_rsqrt_norm_stats, lambda dt, dev: (randn(4, 3, 256, dtype=dt, device=dev),)),
    # offset from 0: a sum of zero-mean values cancels, and its relative error then measures luck
    "sum_all": (_sum_all, lambda dt, dev: ((randn(1000, 37, device=dev) * 0.5 + 1).to(dt),)),
    "add_then_sum_of_view": (_add_then_sum_of_view, lambda dt, dev: (randn(4, 9, 40, dtype=dt, device=dev),
                                                                     randn(4, 9, 40, dtype=dt, device=dev))),
    "masks_odd": (_masks_odd, lambda dt, dev: (randn(7, 33, dtype=dt, device=dev), randn(7, 33, dtype=dt, device=dev))),
    "grad_like": (_grad_like, lambda dt, dev: (randn(64, 48, dtype=dt, device=dev), randn(64, 48, dtype=dt, device=dev))),
}


def _flat(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _region_of(fn: Callable, args: tuple):
    """The IR of `fn`'s whole computation trace (traced by Thunder on the given CPU tensors). Its
    arguments are the inputs the trace reads (`_used_args` picks them from `args`)."""
    region, ins = traced_region(fn, args)
    region.positions = [_position(fn, p.name) for p in ins]  # type: ignore[attr-defined]
    return region


def _position(fn: Callable, name: str) -> int:
    """Which positional argument of `fn` Thunder named `name` (its parameter's name, maybe t_-prefixed)."""
    import inspect

    params = list(inspect.signature(fn).parameters)
    for cand in (name, name.removeprefix("t_")):
        if cand in params:
            return params.index(cand)
    raise AssertionError(f"{name} is none of {params}")


def _used_args(region, args: tuple) -> list:
    return [args[i] for i in region.positions]


# ---- CPU: the IR means what the trace means; the sources compile -------------------------------------
@pytest.mark.parametrize("dtype", DTYPES3, ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_lowering_matches_eager(case: str, dtype: torch.dtype) -> None:
    from kforge.fusion import reference

    fn, make = CASES[case]
    args = make(dtype, "cpu")
    region = _region_of(fn, args)
    outs = reference.evaluate(region, _used_args(region, args))
    ref = [r for r in _flat(fn(*args))]
    assert len(outs) == len(ref)
    for o, r in zip(outs, ref):
        assert o.dtype == r.dtype and o.shape == r.shape, f"{case}: {o.dtype}{tuple(o.shape)} vs {r.dtype}{tuple(r.shape)}"
        assert_close(o, r, dtype if r.is_floating_point() else torch.float32, case, tol=TOL[dtype] * 5)


def _layout_keys(region) -> list[str]:
    from kforge.fusion import codegen

    n = sum(1 for a in region.args if a.op == "input")
    keys = {codegen.default_key(region), "su" * n, "cu" * n, "sa" * n + "L"}
    if n > 1:
        keys.add("ca" + "su" * (n - 1))
    return sorted(keys)


def _assert_waits_first(source: str) -> None:
    """Every generated kernel starts with kf_wait_prior_grids() (the runtime's dependent launches)."""
    lines = source.splitlines()
    kernels = [i for i, l in enumerate(lines) if "__global__" in l]
    assert kernels
    for i in kernels:
        assert lines[i + 1].strip() == "kf_wait_prior_grids();", lines[i:i + 2]


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sources_compile(case: str, arch: int) -> None:
    import kforge
    from kforge.fusion import codegen

    fn, make = CASES[case]
    for dtype in (torch.float32, torch.bfloat16):
        region = _region_of(fn, make(dtype, "cpu"))
        for key in _layout_keys(region):
            for sm in (132, 8):  # a small SM count forces the split reductions
                ks = codegen.generate(region, key, sm_count=sm)
                _assert_waits_first(ks.source)
                lowered = kforge._C.compile_generated(ks.program, ks.source, [l[0] for l in ks.launches], arch)
                assert len(lowered) == len(ks.launches)


def test_vector_loads_where_contiguous() -> None:
    """Contiguous aligned inputs whose runs are unit-stride are read in whole runs; a transposed one
    is not (its lanes are not consecutive in memory)."""
    from kforge.fusion import codegen

    x, cos, sin = CASES["rope"][1](torch.bfloat16, "cpu")
    region = _region_of(_rope, (x, cos, sin))
    ks = codegen.generate(region, codegen.default_key(region))
    assert ks.vec == 8 and ks.source.count("kf_load_run<bf16, 8>") >= 4, ks.source
    region = _region_of(_transpose_add, CASES["transpose_add"][1](torch.float32, "cpu"))
    ks = codegen.generate(region, codegen.default_key(region))
    assert ks.source.count("kf_load_run") == 1, ks.source  # y only


def test_index_math_and_rounding_of_rope() -> None:
    """bf16 RoPE: a load at the output's own coordinates of a same-shape contiguous input is `e0`
    itself (no division chain), the cat picks its half once per run (the half boundary is whole
    runs), and the negation of a bf16 value is not rounded again (it is exact): three roundings,
    one per product and one for the sum."""
    from kforge.fusion import codegen

    x, cos, sin = CASES["rope"][1](torch.bfloat16, "cpu")
    region = _region_of(_rope, (x, cos, sin))
    src = codegen.generate(region, codegen.default_key(region)).source
    body = src[src.index("{"):]
    assert "kf_load_run<bf16, 8>(in0 + e0)" in body, src
    assert "(((e0 % 64)) < 32 ?" in body and "(e0 + v) % 64" not in body, src
    assert body.count("kf_round<bf16>") == 3, src


def test_sources_do_not_depend_on_proxy_names() -> None:
    """Equal structures give equal source text, whatever the trace called their values: the NVRTC
    cache (keyed by the text) then finds a kernel compiled for a region traced under other names
    (a restored program, another model)."""
    from kforge.fusion import codegen

    def f(alpha, beta):
        return torch.tanh(alpha * beta) + alpha

    def g(x, y):
        return torch.tanh(x * y) + x

    args = (randn(5, 24, device="cpu"), randn(5, 24, device="cpu"))
    ra, rb = _region_of(f, args), _region_of(g, args)
    assert {v.name for v in ra.values} != {v.name for v in rb.values}
    ka, kb = (codegen.generate(r, codegen.default_key(r)) for r in (ra, rb))
    assert ka.source == kb.source and ka.program == kb.program


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_exact_values_are_not_rounded_again(dtype: torch.dtype) -> None:
    """abs / neg / max of 16-bit inputs widened to fp32 are 16-bit numbers: narrowing them back needs
    no rounding; a product does."""
    from kforge.fusion import codegen

    ctype = {torch.bfloat16: "bf16", torch.float16: "half"}[dtype]

    def fn(x, y):
        return torch.maximum(-x.float(), y.float().abs()).to(dtype), (x.float() * y.float()).to(dtype)

    region, _ = _ir_of(fn, randn(7, 24, dtype=dtype, device="cpu"), randn(7, 24, dtype=dtype, device="cpu"))
    src = codegen.generate(region, codegen.default_key(region)).source
    assert src[src.index("{"):].count(f"kf_round<{ctype}>") == 1, src


def test_unsupported_is_explained() -> None:
    from kforge.fusion import codegen, ir as fir

    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(fir.Unsupported, match="float64"):
        _region_of(lambda a: a * 2, (x,))
    region = _region_of(lambda a: (a - a.amax(-1, keepdim=True)).exp(), (torch.randn(4, 8),))
    with pytest.raises(fir.Unsupported, match="another element|normalisation|reduced shape|input shape"):
        codegen.generate(region, codegen.default_key(region))


# ---- generated chains of prims ------------------------------------------------------------------------
_UNARY = {
    "neg": torch.neg, "abs": torch.abs, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "sin": torch.sin,
    "exp_neg": lambda x: torch.exp(-torch.abs(x)), "sqrt_abs": lambda x: torch.sqrt(torch.abs(x) + 0.25),
    "square": lambda x: x * x, "relu": F.relu, "silu": F.silu, "erf": torch.erf, "scale": lambda x: x * 0.37 + 1.5,
    "log1p_abs": lambda x: torch.log1p(torch.abs(x)), "floor": lambda x: torch.floor(x * 4),
}
_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "max": torch.maximum, "min": torch.minimum,
    "where_gt": lambda a, b: torch.where(a > b, a, b * 0.5), "div_safe": lambda a, b: a / (b.abs() + 1.0),
}


@st.composite
def chains(draw):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.sampled_from([1, 2, 3, 5, 8, 16, 33])) for _ in range(rank))
    dtype = draw(st.sampled_from(DTYPES3))
    n_in = draw(st.integers(1, 3))
    steps = []
    n_vals = n_in
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["u", "u", "b", "b", "t", "r", "s"]))
        a = draw(st.integers(0, n_vals - 1))
        if kind == "u":
            steps.append(("u", draw(st.sampled_from(sorted(_UNARY))), a))
        elif kind == "b":
            steps.append(("b", draw(st.sampled_from(sorted(_BINARY))), a, draw(st.integers(0, n_vals - 1))))
        elif kind == "t":
            steps.append(("t", a))  # flip the dim order twice: a transpose pair
        elif kind == "r":
            steps.append(("r", a))  # reshape to 1-D and back
        else:
            steps.append(("s", a, draw(st.integers(0, rank - 1)), draw(st.booleans())))  # reduce a dim
        n_vals += 1
    reduce_last = draw(st.booleans())
    return shape, dtype, n_in, steps, reduce_last


def _chain_fn(shape, steps, reduce_last, n_in: int = 3):
    def body(*xs):
        vals = list(xs)
        for s in steps:
            if s[0] == "u":
                vals.append(_UNARY[s[1]](vals[s[2]]))
            elif s[0] == "b":
                a, b = vals[s[2]], vals[s[3]]
                if a.shape != b.shape:
                    b = b.sum() if b.dim() else b
                vals.append(_BINARY[s[1]](a, b))
            elif s[0] == "t":
                v = vals[s[1]]
                rev = tuple(range(v.dim() - 1, -1, -1))
                vals.append(v.permute(rev).contiguous().permute(rev) * 1.0)
            elif s[0] == "r":
                v = vals[s[1]]
                vals.append(v.reshape(-1).reshape(v.shape) + 0.5)
            else:
                v, d, keep = vals[s[1]], s[2], s[3]
                vals.append((v.sum(min(d, v.dim() - 1), keepdim=True) if v.dim() else v) * 0.5 + 0 * v if keep else
                            v.float().amax(min(d, v.dim() - 1), keepdim=True).to(v.dtype) + v if v.dim() else v)
        out = vals[-1]
        return out.sum(-1) if reduce_last and out.dim() else out

    # named parameters, so a trace's inputs map back to arguments by name
    return {1: lambda a0: body(a0), 2: lambda a0, a1: body(a0, a1), 3: lambda a0, a1, a2: body(a0, a1, a2)}[n_in]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(chains())
def test_generated_chains_lower_and_compile(chain) -> None:
    import kforge
    from kforge.fusion import codegen, ir as fir, reference

    shape, dtype, n_in, steps, reduce_last = chain
    fn = _chain_fn(shape, steps, reduce_last, n_in)
    args = tuple(randn(*shape, dtype=dtype, device="cpu", seed=i) for i in range(n_in))
    try:
        region = _region_of(fn, args)
    except fir.Unsupported as e:
        hypothesis.note(f"not one region: {e}")
        hypothesis.assume(False)
    outs = reference.evaluate(region, _used_args(region, args))
    ref = _flat(fn(*args))
    for o, r in zip(outs, ref):
        assert_close(o.float(), r.float(), torch.float32, "chain", tol=TOL[dtype] * 10)
    try:
        ks = codegen.generate(region, codegen.default_key(region))
    except fir.Unsupported:
        return  # a shape the schedules do not take (the partitioner would split it)
    kforge._C.compile_generated(ks.program, ks.source, [l[0] for l in ks.launches], 90)


# ---- the partitioner on users' models, traced as on a GPU ---------------------------------------------
def _fusions(trace) -> list:
    return [b for b in trace.bound_symbols if b.sym.name.startswith("kforgeFusion")]


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
@pytest.mark.parametrize("model", ["plain_llama", "nanogpt"])
def test_users_models_fuse(model: str, autocast: bool) -> None:
    """Under kforge.jit every elementwise / view / reduction chain of a user's model is a region;
    each region's source compiles; backward regions carry Thunder's BACKWARD tag; inspect lists them."""
    import importlib

    import kforge
    from conftest import fake_cuda_trace
    from kforge.fusion import codegen, executor as fx
    from kforge.inspect import inspect
    from thunder.core.symbol import BoundSymbolTag

    make = importlib.import_module(f"kforge.zoo.{model}").make
    ft = fake_cuda_trace(make, jit=kforge.jit, size="micro", batch=2, seq=16, autocast=autocast)
    for trace in (ft.forward, ft.backward):
        fusions = _fusions(trace)
        # the plain Llama's autocast forward has none left: its casts and adds are in kforge's norms
        assert fusions or (trace is ft.forward and model == "plain_llama" and autocast), "no fusion in the trace"
        for b in fusions:
            names = {s.sym.name for s in b.subsymbols}
            assert not names & {"linear", "matmul"}, names
            region = fx.lower_fusion(b)
            ks = codegen.generate(region, codegen.default_key(region))
            if ks.launches:  # a pass-through region (outputs are inputs) has no source
                kforge._C.compile_generated(ks.program, ks.source, [l[0] for l in ks.launches], 90)
        # every elementwise prim left at the top level is one the fusion cannot take
        left = [b.sym.name for b in trace.bound_symbols if b.sym.name in ("mul", "add", "exp", "neg", "where", "to")]
        assert not left, left
    assert all(BoundSymbolTag.BACKWARD in b.tags for b in _fusions(ft.backward))
    report = inspect(ft.fn)
    assert len(report.fusions) == len(_fusions(ft.forward)) + len(_fusions(ft.backward))
    assert "kforgeFusion" in str(report)


_VIEW_PRIM_NAMES = {"reshape", "broadcast_in_dim", "transpose", "squeeze", "shallow_copy"}


def _view_outputs(b) -> list[str]:
    """Outputs of fusion symbol `b` that are a view (one view prim) of another of its outputs."""
    outs = {o.name for o in b.output}
    found = []

    def walk(bsyms):
        for s in bsyms:
            if s.subsymbols and s.sym.name not in _VIEW_PRIM_NAMES:
                walk(s.subsymbols)
            elif (s.sym.name in _VIEW_PRIM_NAMES and s.flat_proxy_args and s.flat_proxy_args[0].name in outs
                  and any(o.name in outs for o in s.flat_proxy_outs)):
                found.append(s.flat_proxy_outs[0].name)

    walk(b.subsymbols)
    return found


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
@pytest.mark.parametrize("model", ["nanogpt", "hf_gpt2", "plain_llama"])
def test_regions_write_no_view_of_their_own_outputs(model: str, autocast: bool) -> None:
    """A view of a region's result read both inside the region and outside is a torch view outside
    and recomputed inside: no region writes the same values twice. HF GPT-2's backward (Conv1D: bias
    gradient summed over a (B*T, C) view of the residual gradient) then has nanoGPT's regions."""
    import importlib

    import kforge
    from conftest import fake_cuda_trace

    def regions(name):
        make = importlib.import_module(f"kforge.zoo.{name}").make
        ft = fake_cuda_trace(make, jit=kforge.jit, size="micro", batch=2, seq=16, autocast=autocast)
        return _fusions(ft.forward), _fusions(ft.backward)

    fwd, bwd = regions(model)
    for b in (*fwd, *bwd):
        assert not _view_outputs(b), (b.sym.name, _view_outputs(b), str(b))
    if model == "hf_gpt2" and not autocast:
        assert len(bwd) == len(regions("nanogpt")[1]), [str(b).splitlines()[0] for b in bwd]


def test_fusion_off_by_environment(monkeypatch) -> None:
    import kforge
    from kforge.fusion import get_fusion_executor

    assert get_fusion_executor() in kforge.executors()
    monkeypatch.setenv("KFORGE_FUSION", "0")
    assert get_fusion_executor() not in kforge.executors()
    monkeypatch.setenv("KFORGE_FUSION", "FALSE")
    assert get_fusion_executor() not in kforge.executors()



# ---- CPU: cast round trips, pass-through outputs, movement views, matmul accumulation ------------------
def _ir_of(fn: Callable, *args):
    region = _region_of(fn, args)
    return region, _used_args(region, args)


@pytest.mark.parametrize("src,mid", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                     (torch.int32, torch.int64), (torch.bool, torch.float32)], ids=str)
def test_widening_round_trip_is_the_input(src: torch.dtype, mid: torch.dtype) -> None:
    """src -> wider -> src is the identity: the output is the region's input, nothing is launched."""
    from kforge.fusion import codegen, reference

    x = randn(6, 8, dtype=torch.float32, device="cpu")
    x = (x > 0) if src == torch.bool else (x * 100).to(src)
    region, args = _ir_of(lambda x: x.to(mid).to(src), x)
    assert region.output_sources() == [-1], region.output_sources()
    assert not [v for v in region.values if v.op == "convert" and v in region.outputs]
    assert codegen.schedule(region).kind == "passthrough"
    assert not codegen.generate(region, codegen.default_key(region)).launches
    assert torch.equal(reference.evaluate(region, args)[0], x)


@pytest.mark.parametrize("src,mid", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                     (torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16),
                                     (torch.int64, torch.int32), (torch.int64, torch.float32),
                                     (torch.float32, torch.int64)], ids=str)
def test_narrowing_round_trip_is_kept(src: torch.dtype, mid: torch.dtype) -> None:
    """src -> narrower (or another format) -> src rounds: both converts stay and a kernel computes it."""
    from kforge.fusion import codegen, reference

    x = randn(6, 8, dtype=torch.float32, device="cpu")
    if (src, mid) == (torch.bfloat16, torch.float16):
        x = (x * 1e5).to(src)          # beyond fp16's range
    elif src == torch.int64:
        x = (x * 1e3).to(src) + 2**33   # beyond int32 / exact only to 2^24 in fp32
    else:
        x = (x + 0.3).to(src)          # more mantissa than the narrower type
    fn = lambda x: x.to(mid).to(src)  # noqa: E731
    region, args = _ir_of(fn, x)
    assert region.output_sources() == [0]
    assert [v.op for v in region.values if v.op == "convert"] == ["convert", "convert"]
    assert codegen.schedule(region).kind == "pointwise"
    assert codegen.generate(region, codegen.default_key(region)).launches
    out = reference.evaluate(region, args)[0]
    assert torch.equal(out, fn(x)) and not torch.equal(out, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32], ids=str)
def test_relu_keeps_nan_as_torch_does(dtype: torch.dtype) -> None:
    """torch.relu(NaN) is NaN; Thunder's decomposition where(a > 0, a, 0) gives 0. The fusion lowers
    relu whole, as a NaN-propagating maximum with 0, so the generated kernel follows torch."""
    from kforge.fusion import codegen, reference

    x = randn(6, 8, dtype=torch.float32, device="cpu") * 4
    if dtype.is_floating_point:
        x[0, 1], x[2, 3], x[4, 5] = float("nan"), float("inf"), -float("inf")
    x = x.to(dtype)
    fn = lambda x: torch.relu(x) + 1  # noqa: E731
    region, args = _ir_of(fn, x)
    assert "maximum" in [v.op for v in region.values] and "where" not in [v.op for v in region.values]
    assert codegen.generate(region, codegen.default_key(region)).launches
    out, ref = reference.evaluate(region, args)[0], fn(x)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.nan_to_num(), ref.nan_to_num())
    if dtype.is_floating_point:
        assert out[0, 1].isnan()


def test_two_outputs_of_one_value_are_written_once() -> None:
    """The backward's residual pattern: cast round trips around an add; both outputs are the add,
    which the kernel computes and writes once; the structural key tells the regions apart."""
    import kforge
    from kforge.fusion import codegen, reference
    from kforge.fusion.executor import structural_key

    def fn(x, y):
        s = x.float().to(torch.bfloat16) + y
        w = s.float()
        return w.to(torch.bfloat16), w.to(torch.bfloat16)

    x, y = (randn(4, 64, dtype=torch.bfloat16, device="cpu", seed=i) for i in range(2))
    region, args = _ir_of(fn, x, y)
    assert region.output_sources() == [0, 0]
    kir = region.for_kernel()
    assert len(kir.outputs) == 1 and sum(v.op == "convert" and v.dtype == "f32" for v in kir.values) == 2
    ks = codegen.generate(region, codegen.default_key(region))
    assert ks.source.count("kf_store") == codegen.generate(kir, codegen.default_key(kir)).source.count("kf_store")
    kforge._C.compile_generated(ks.program, ks.source, [l[0] for l in ks.launches], 90)
    outs = reference.evaluate(region, args)
    ref = fn(x, y)
    assert torch.equal(outs[0], ref[0]) and torch.equal(outs[1], ref[1])
    one, _ = _ir_of(lambda x, y: fn(x, y)[0], x, y)
    assert structural_key(one) != structural_key(region)


@pytest.mark.parametrize("case,plan", [
    ("bhtd_to_btc", [("permute", (0, 2, 1, 3)), ("reshape", (2, 5, 12))]),
    ("unsqueeze", [("reshape", (2, 1, 3, 4, 5))]),
    ("slice_transpose_reshape", [("slice", (0, 0, 1, 0), (1, 1, 1, 1), (2, 3, 3, 5)), ("permute", (0, 2, 1, 3)),
                                 ("reshape", (2, 9, 5))]),
    ("contiguous", [("permute", (0, 2, 1, 3)), ("contiguous",)]),
    ("expand", None), ("transpose_neg", None), ("cast", None)])
def test_movement_view_plans(case: str, plan) -> None:
    """Regions that only move elements of one input get a view plan (the launcher returns a view
    when the run-time strides allow); anything computed, or an expanding broadcast, has none."""
    from kforge.fusion import ir as fir

    fns = {
        "bhtd_to_btc": lambda x: x.transpose(1, 2).reshape(2, 5, 12),
        "unsqueeze": lambda x: x.unsqueeze(1),
        "contiguous": lambda x: x.transpose(1, 2).contiguous(),
        "slice_transpose_reshape": lambda x: x[:, :, 1:4].transpose(1, 2).reshape(2, 9, 5),
        "expand": lambda x: x[:, :1].expand(2, 3, 4, 5).transpose(1, 2).reshape(2, 4, 15),
        "transpose_neg": lambda x: (-x).transpose(1, 2).reshape(2, 5, 12),
        "cast": lambda x: x.transpose(1, 2).reshape(2, 5, 12).to(torch.float16),
    }
    shape = (2, 3, 5, 4) if case in ("bhtd_to_btc", "contiguous") else (2, 3, 4, 5)
    region, _ = _ir_of(fns[case], randn(*shape, device="cpu"))
    got = fir.view_plan(region)
    if plan is None:
        assert got is None, got
    else:
        assert got == (0, [tuple(s) for s in plan]), got


def _matmul_sum(g1, w1, g2, w2, g3, w3):
    B, T = 2, g1.shape[0] // 2
    return (g1 @ w1).reshape(B, T, -1) + (g2 @ w2).reshape(B, T, -1) + (g3 @ w3).reshape(B, T, -1)


def _accumulated(fn: Callable, args: tuple, rewrite: str | Callable = "accumulate_matmuls"):
    """fn's trace with matmul accumulation (or `rewrite`, another pass of kforge.fusion.matmul_acc)
    applied on CPU, as a callable run by Thunder's torch executor."""
    import thunder
    from thunder.core.trace import from_trace
    from thunder.executors.passes import transform_for_execution
    from thunder.executors.torchex import ex as torch_ex

    from kforge.fusion import matmul_acc

    jf = thunder.jit(fn)
    jf(*args)
    tr = thunder.last_traces(jf)[0]
    if rewrite == "gather_input_casts":
        from kforge.fusion.executor import _returned, _trace_inputs
        from kforge.fusion.input_casts import gather_input_casts

        bsyms, n = gather_input_casts(tr.bound_symbols, _trace_inputs(tr), _returned(tr), devices=("cpu",))
    else:
        from thunder.core.trace import tracectx

        with tracectx(tr):  # passes that make proxies name them in the trace
            rewrite = getattr(matmul_acc, rewrite) if isinstance(rewrite, str) else rewrite
            bsyms, n = rewrite(tr.bound_symbols, devices=("cpu",))
    new = from_trace(tr)
    new.bound_symbols = bsyms
    names = [b.sym.name for b in bsyms]
    return transform_for_execution(new, executors_list=(torch_ex,)).python_callable(), names, n


ACC = "kforge_matmul_accumulate"  # c.addmm_(a, w): the sum's accumulation in cuBLAS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matmul_sum_accumulates_in_addmm(dtype: torch.dtype) -> None:
    """reshape(g1 @ W1) + reshape(g2 @ W2) + reshape(g3 @ W3): one matmul, two addmm, no add; the
    result within the dtype's rounding of a float64 reference and at least as close as eager."""
    args = tuple(randn(*s, dtype=dtype, device="cpu", seed=i)
                 for i, s in enumerate([(8, 16), (16, 24), (8, 32), (32, 24), (8, 8), (8, 24)]))
    run, names, n = _accumulated(_matmul_sum, args)
    assert n == 2 and names.count(ACC) == 2 and names.count("matmul") == 1 and "add" not in names, names
    out = _flat(run(*args))[0]
    ref = _matmul_sum(*(a.double() for a in args))
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close(out, ref.to(dtype), dtype, "addmm chain")
    eager_err = (_matmul_sum(*args).double() - ref).abs().max()
    assert (out.double() - ref).abs().max() <= eager_err * 1.01 + 1e-12


def _reused(a, w, b, v):
    m = a @ w
    return m + (b @ v), m


@pytest.mark.parametrize("case", ["reused", "broadcast", "batched", "scaled", "mixed_dtype"])
def test_matmul_sum_left_alone(case: str) -> None:
    """Not rewritten: a matmul result read elsewhere too, a broadcast term, a 3-D matmul, alpha != 1,
    terms of different dtypes."""
    a, w, b, v = (randn(*s, device="cpu", seed=i) for i, s in enumerate([(4, 6), (6, 5), (4, 7), (7, 5)]))
    fns = {
        "reused": (_reused, (a, w, b, v)),
        "broadcast": (lambda a, w, b, v: (a @ w) + (b[:1] @ v), (a, w, b, v)),
        "batched": (lambda a, w, b, v: (a @ w) + (b @ v), (a.expand(3, 4, 6), w, b.expand(3, 4, 7), v)),
        "scaled": (lambda a, w, b, v: torch.add(a @ w, b @ v, alpha=2), (a, w, b, v)),
        "mixed_dtype": (lambda a, w, b, v: (a @ w) + (b @ v), (a, w, b.double(), v.double())),
    }
    fn, args = fns[case]
    run, names, n = _accumulated(fn, args)
    assert n == 0 and ACC not in names, names
    for o, r in zip(_flat(run(*args)), _flat(fn(*args))):
        assert torch.allclose(o, r)


WIDEN = "kforge_matmul_widen"  # a @ w stored as float32 by the matmul itself


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_matmul_converted_to_float32_is_one_widening_matmul(dtype: torch.dtype) -> None:
    """(a @ w).float() for 16-bit a, w: one float32-output matmul, no conversion; closer to a float64
    reference than eager's (which rounds the product to 16 bits first) and within fp32 rounding of it."""
    a, w = randn(40, 72, dtype=dtype, device="cpu", seed=1), randn(72, 24, dtype=dtype, device="cpu", seed=2)
    fn = lambda a, w: (a @ w).float() * 2  # noqa: E731
    run, names, n = _accumulated(fn, (a, w), "widen_matmuls")
    assert n == 1 and names.count(WIDEN) == 1 and "matmul" not in names, names
    assert not [x for x in names if x in ("convert_element_type", "to", "float")], names
    out = _flat(run(a, w))[0]
    ref = fn(a.double(), w.double())
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert_close(out, ref.float(), torch.float32, "widened matmul", tol=1e-5)
    eager_err = (fn(a, w).double() - ref).abs().max()
    assert (out.double() - ref).abs().max() < eager_err


@pytest.mark.parametrize("case", ["reused", "float32", "narrowing", "batched", "reshaped"])
def test_matmul_conversion_left_alone(case: str) -> None:
    """Not rewritten: a product read elsewhere too, float32 inputs, a conversion to a narrower type, a
    3-D matmul, a reshape between the matmul and the conversion."""
    a, w = randn(6, 8, device="cpu", seed=3), randn(8, 5, device="cpu", seed=4)
    h, hw = a.bfloat16(), w.bfloat16()

    def reused(a, w):
        m = a @ w
        return m.float(), m

    fns = {
        "reused": (reused, (h, hw)),
        "float32": (lambda a, w: (a @ w).double(), (a, w)),
        "narrowing": (lambda a, w: (a @ w).bfloat16(), (a, w)),
        "batched": (lambda a, w: (a @ w).float(), (h.expand(3, 6, 8), hw)),
        "reshaped": (lambda a, w: (a @ w).reshape(2, 15).float(), (h, hw)),
    }
    fn, args = fns[case]
    run, names, n = _accumulated(fn, args, "widen_matmuls")
    assert n == 0 and WIDEN not in names, names
    for o, r in zip(_flat(run(*args)), _flat(fn(*args))):
        assert o.dtype == r.dtype and torch.equal(o, r)


def _upcast_sum(g1, w1, g2, w2, g3, w3):
    B, T = 2, g1.shape[0] // 2
    return ((g1 @ w1).reshape(B, T, -1).float() + (g2 @ w2).reshape(B, T, -1).float()
            + (g3 @ w3).reshape(B, T, -1).float())


def test_upcast_reshaped_matmul_read_from_memory_is_a_widening_matmul() -> None:
    """float(reshape(g @ W)) read by a kernel that takes it from memory (the last norm's gradient from
    the lm_head under autocast; here any reader, `stores`): a widening matmul and a reshape, no
    conversion; within fp32 rounding of float64 and closer than eager."""
    from functools import partial

    from kforge.fusion import matmul_acc

    g, w = randn(12, 20, dtype=torch.bfloat16, device="cpu", seed=1), randn(20, 6, dtype=torch.bfloat16, device="cpu", seed=2)
    fn = lambda g, w: (g @ w).reshape(3, 4, 6).float() * 3  # noqa: E731
    widen = partial(matmul_acc.widen_matmuls, stores=lambda b: True)
    run, names, n = _accumulated(fn, (g, w), widen)
    assert n == 1 and names.count(WIDEN) == 1 and "matmul" not in names and "convert_element_type" not in names, names
    out = _flat(run(g, w))[0]
    ref = fn(g.double(), w.double())
    assert out.dtype == torch.float32
    assert_close(out, ref.float(), torch.float32, "widened reshape", tol=1e-5)
    assert (out.double() - ref).abs().max() < (fn(g, w).double() - ref).abs().max()


@pytest.mark.parametrize("case", ["sum", "elementwise_reader", "reused", "float32", "mixed_16_bit", "batched"])
def test_upcast_reshaped_matmul_left_alone(case: str) -> None:
    """Not widened: terms of an fp32 sum of upcast products (autocast's q / k / v input gradients: in a
    region their float32 values are never stored, and widened products would double the bytes), an
    upcast read by an elementwise op, a product read elsewhere too, fp32 products, a 3-D matmul."""
    a, w, b, v = (randn(*s, device="cpu", seed=i) for i, s in enumerate([(4, 6), (6, 5), (4, 7), (7, 5)]))
    h = [t.bfloat16() for t in (a, w, b, v)]

    def reused(a, w):
        m = a @ w
        return m.reshape(2, 10).float() * 2, m

    sum_args = tuple(randn(*s, dtype=torch.bfloat16, device="cpu", seed=i)
                     for i, s in enumerate([(8, 16), (16, 24), (8, 32), (32, 24), (8, 8), (8, 24)]))
    fns = {
        "sum": (_upcast_sum, sum_args),
        "elementwise_reader": (lambda a, w: (a @ w).reshape(2, 10).float() * 2, h[:2]),
        "reused": (reused, h[:2]),
        "float32": (lambda a, w: (a @ w).reshape(2, 10).double(), (a, w)),
        "mixed_16_bit": (lambda a, w, b, v: (a @ w).reshape(2, 10).float() + (b @ v).reshape(2, 10).float(),
                         (*h[:2], b.half(), v.half())),
        "batched": (lambda a, w: (a @ w).reshape(3, 20).float(), (h[0].expand(3, 4, 6), h[1])),
    }
    fn, args = fns[case]
    run, names, n = _accumulated(fn, args, "widen_matmuls")
    assert n == 0 and WIDEN not in names, names
    for o, r in zip(_flat(run(*args)), _flat(fn(*args))):
        assert o.dtype == r.dtype and torch.equal(o, r)


def test_autocast_weight_gradients_come_from_widening_matmuls(monkeypatch) -> None:
    """The fake-traced plain Llama under autocast: every linear weight's gradient (fp32 weights, bf16
    matmuls) is one float32-output matmul; no region converts a matmul's result any more."""
    from conftest import fake_cuda_trace
    from kforge.zoo import plain_llama

    monkeypatch.setenv("KFORGE_GEMM", "0")  # the fusion's names, before kforge.ops.gemm renames them
    ft = fake_cuda_trace(plain_llama.make, size="micro", batch=2, seq=16, autocast=True)
    names = [b.sym.name for b in ft.backward.bound_symbols]
    n_layers = names.count("kforge_swiglu_backward")
    assert n_layers >= 1
    # weight gradients: q k v o w1 w2 w3, lm_head; and the lm_head's input gradient, which the last
    # norm's backward reads (the q / k / v and w1 / w3 input-gradient sums stay 16-bit products)
    assert names.count(WIDEN) == 7 * n_layers + 2, (names.count(WIDEN), n_layers)
    assert ACC not in names
    producers = {o.name: b for b in ft.backward.bound_symbols for o in b.flat_proxy_outs}
    for b in _fusions(ft.backward):
        inputs = [producers.get(p.name) for p in b.flat_proxy_args]
        assert not any(p is not None and p.sym.name == "matmul" and len(b.subsymbols) == 1
                       and b.subsymbols[0].sym.name == "convert_element_type" for p in inputs), b


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(8192, 768, 2048), (97, 33, 65), (1, 64, 1)], ids=str)
def test_widening_matmul_on_gpu_matches_float64(dtype: torch.dtype, shape: tuple) -> None:
    """kforge_matmul_widen's CUDA path (cuBLAS mm with out_dtype float32), odd and strided operands:
    float32 results within fp32 accumulation error of float64, closer than eager's bf16-rounded product."""
    from kforge.fusion.matmul_acc import widen_mm

    m, k, n = shape
    a = randn(k, m, dtype=dtype, seed=5).t()  # transposed: the weight gradient's g^T
    w = randn(k, n, dtype=dtype, seed=6)
    out = widen_mm(a, w)
    ref = a.double() @ w.double()
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert_close(out, ref.float(), torch.float32, "widen", tol=2e-5)
    assert (out.double() - ref).abs().max() <= ((a @ w).double() - ref).abs().max()


def test_repeated_views_and_conversions_are_computed_once() -> None:
    """Identical reshapes / permutes / conversions of one tensor: the first is kept and later readers
    use it; one with other arguments, or of another tensor, stays. The results equal eager's."""
    import thunder
    from thunder.core.trace import from_trace
    from thunder.executors.passes import transform_for_execution
    from thunder.executors.torchex import ex as torch_ex

    from kforge.fusion.dedupe import dedupe_views

    def fn(x, y):
        bf16 = torch.bfloat16
        return (x.reshape(6, 4) * 2, x.reshape(6, 4) + 1, x.reshape(4, 6) - 1, y.reshape(6, 4) * 3,
                x.permute(1, 0) * 3, x.permute(1, 0) - 1, x.to(bf16) * 2, x.to(bf16) + 1, x.to(torch.float16))

    x, y = randn(4, 6, device="cpu", seed=1), randn(4, 6, device="cpu", seed=2)
    jf = thunder.jit(fn)
    jf(x, y)
    tr = thunder.last_traces(jf)[0]
    views = lambda bs: [b.sym.name for b in bs if b.sym.name in ("reshape", "permute", "to")]  # noqa: E731
    assert len(views(tr.bound_symbols)) == 9
    bsyms, n = dedupe_views(tr.bound_symbols)
    assert n == 3 and len(views(bsyms)) == 6, views(bsyms)
    new = from_trace(tr)
    new.bound_symbols = bsyms
    run = transform_for_execution(new, executors_list=(torch_ex,)).python_callable()
    for o, r in zip(run(x, y), fn(x, y)):
        assert torch.equal(o, r)


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
def test_users_models_have_no_repeated_views_or_casts(autocast: bool) -> None:
    """The fake-traced plain Llama and nanoGPT: no two identical view symbols in the final traces, and
    under autocast each RMSNorm output is cast to bf16 once however many projections read it (the
    q / k / v and w1 / w3 casts were separate, each saved for its weight's gradient)."""
    import collections

    from conftest import fake_cuda_trace
    from kforge.zoo import nanogpt, plain_llama

    for make in (plain_llama.make, nanogpt.make):
        ft = fake_cuda_trace(make, size="micro", batch=2, seq=16, autocast=autocast)
        if autocast and make is plain_llama.make:
            norms = [b for b in ft.forward.bound_symbols if b.sym.name == "kforge_rmsnorm_forward"]
            readers = collections.Counter(p.name for b in _fusions(ft.forward) for p in b.flat_proxy_args)
            assert norms and all(readers[b.flat_outs[0].name] <= 1 for b in norms), readers
        for tr in (ft.forward, ft.backward):
            seen = collections.Counter((b.sym.name, str(b.args)) for b in tr.bound_symbols
                                       if b.sym.name in ("reshape", "permute", "transpose", "view"))
            assert not [k for k, v in seen.items() if v > 1], [k for k, v in seen.items() if v > 1][:3]


CASTS = "kforge_cast_inputs"  # the forward's casts of its inputs that outlive it, made together


def test_returned_input_casts_are_made_together() -> None:
    """Casts of trace inputs that the trace returns become one kforge_cast_inputs at the first one's
    place; a large cast only used inside the trace stays where it was. Outputs equal eager's bit for bit."""
    from kforge.fusion.input_casts import SMALL

    a, b, c = (randn(*s, device="cpu", seed=i) for i, s in enumerate([(5, 7), (SMALL + 3,), (2, 3, 4)]))
    bf16, fp16 = torch.bfloat16, torch.float16
    fn = lambda a, b, c: (a.to(bf16), b.to(bf16) * 2, c.to(bf16), a.to(fp16))  # noqa: E731
    run, names, n = _accumulated(fn, (a, b, c), "gather_input_casts")
    assert n == 2 and names.count(CASTS) == 1, names  # a and c to bf16; b's is used, a.half() alone
    assert names.index(CASTS) < names.index("mul"), names
    for o, r in zip(_flat(run(a, b, c)), _flat(fn(a, b, c))):
        assert o.dtype == r.dtype and torch.equal(o, r)


def test_small_input_casts_join_whatever_their_use() -> None:
    """Casts of small inputs (biases) used only inside the trace join the gathered casts; a large
    one used only inside stays where it is (gathering it would keep it alive longer). Bit for bit."""
    from kforge.fusion.input_casts import SMALL

    w, big = randn(9, 5, device="cpu", seed=1), randn(SMALL + 1, device="cpu", seed=2)
    b1, b2 = randn(9, device="cpu", seed=3), randn(SMALL, device="cpu", seed=4)
    bf16 = torch.bfloat16

    def fn(w, big, b1, b2):
        return w.to(bf16), (big.to(bf16) * 2).sum(), b1.to(bf16) + 1, b2.to(bf16) * 3
    args = (w, big, b1, b2)
    run, names, n = _accumulated(fn, args, "gather_input_casts")
    assert n == 3 and names.count(CASTS) == 1, names  # w (returned), b1, b2 (small); not big
    assert names.count("to") == 1 and names.index(CASTS) < names.index("to"), names  # big's, in place
    for o, r in zip(_flat(run(*args)), _flat(fn(*args))):
        assert o.dtype == r.dtype and torch.equal(o, r)
    # small casts alone are gathered too (inference: no cast is returned), at least two of them
    run, names, n = _accumulated(lambda b1, b2: b1.to(bf16) + 1 + b2.to(bf16)[:9], (b1, b2), "gather_input_casts")
    assert n == 2 and names.count(CASTS) == 1, names


@pytest.mark.parametrize("case", ["one", "used_inside", "intermediate", "same_dtype"])
def test_input_casts_left_alone(case: str) -> None:
    """Not gathered: a lone cast, large casts the trace only uses, a cast of a computed tensor, a
    no-op cast."""
    from kforge.fusion.input_casts import SMALL

    a, b = randn(4, 6, device="cpu", seed=7), randn(6, device="cpu", seed=8)
    if case == "used_inside":
        a, b = randn(SMALL + 1, device="cpu", seed=7), randn(SMALL + 7, device="cpu", seed=8)
    fns = {
        "one": lambda a, b: (a.to(torch.bfloat16), b * 2),
        "used_inside": lambda a, b: a.to(torch.bfloat16) * 2 + b[:a.shape[0]].to(torch.bfloat16),
        "intermediate": lambda a, b: ((a * 2).to(torch.bfloat16), (b + 1).to(torch.bfloat16)),
        "same_dtype": lambda a, b: (a.float(), b.to(torch.float32), a * 2),
    }
    fn = fns[case]
    run, names, n = _accumulated(fn, (a, b), "gather_input_casts")
    assert n == 0 and CASTS not in names, names
    for o, r in zip(_flat(run(a, b)), _flat(fn(a, b))):
        assert o.dtype == r.dtype and torch.equal(o, r)


def test_autocast_weight_casts_are_one_symbol() -> None:
    """The fake-traced plain Llama under autocast: the forward casts its fp32 weights to bf16 in one
    kforge_cast_inputs (every linear weight: 7 per layer and lm_head); no fusion region casts a
    weight, and the tensors saved for backward are the same as without the gathering."""
    from conftest import fake_cuda_trace
    from kforge.fusion import executor as fx
    from kforge.zoo import plain_llama

    ft = fake_cuda_trace(plain_llama.make, size="micro", batch=2, seq=16, autocast=True)
    casts = [b for b in ft.forward.bound_symbols if b.sym.name == CASTS]
    n_layers = sum(1 for b in ft.backward.bound_symbols if b.sym.name == "kforge_swiglu_backward")
    assert len(casts) == 1 and len(casts[0].flat_outs) == 7 * n_layers + 1, [len(c.flat_outs) for c in casts]
    weights = {p.name for p in casts[0].flat_proxy_args}
    for b in _fusions(ft.forward):
        assert not weights & {p.name for p in b.flat_proxy_args}, b
    saved = sorted((tuple(p.shape), str(p.dtype)) for p in fx._trace_inputs(ft.backward))
    real = fx.gather_input_casts
    try:
        fx.gather_input_casts = lambda bsyms, *a, **k: (list(bsyms), 0)
        plain = fake_cuda_trace(plain_llama.make, size="micro", batch=2, seq=16, autocast=True)
    finally:
        fx.gather_input_casts = real
    assert not [b for b in plain.forward.bound_symbols if b.sym.name == CASTS]
    assert saved == sorted((tuple(p.shape), str(p.dtype)) for p in fx._trace_inputs(plain.backward))


@gpu
def test_cast_inputs_on_gpu_equal_torch() -> None:
    """kforge_cast_inputs on CUDA (torch._foreach_copy_ into fresh tensors): odd sizes, more tensors
    than one multi-tensor launch takes, a transposed input; each output equals x.to(dtype) exactly."""
    from kforge.fusion.input_casts import cast_all
    from thunder.core import dtypes

    xs = [randn(n, seed=n) * 1e3 for n in range(1, 300, 7)] + [randn(65, 33, seed=1).t(), randn(4097, 3, seed=2)]
    for dt, tdt in ((dtypes.bfloat16, torch.bfloat16), (dtypes.float16, torch.float16)):
        outs = cast_all(xs, dt)
        assert len(outs) == len(xs)
        for o, x in zip(outs, xs):
            assert o.dtype == tdt and o.shape == x.shape and torch.equal(o, x.to(tdt))


def test_llama_backward_regions_with_addmm(monkeypatch) -> None:
    """The fake-traced plain Llama: q / k / v and w1 / w3 input gradients are accumulated by cuBLAS
    (2 + 1 per layer) and their add regions are gone."""
    import kforge
    from conftest import fake_cuda_trace
    from kforge.fusion import executor as fx, matmul_acc
    from kforge.zoo import plain_llama

    monkeypatch.setenv("KFORGE_GEMM", "0")  # the fusion's names, before kforge.ops.gemm renames them

    def trace(accumulate: bool):
        if not accumulate:
            monkeypatch.setattr(fx, "accumulate_matmuls", lambda bsyms: (list(bsyms), 0))
        else:
            monkeypatch.setattr(fx, "accumulate_matmuls", matmul_acc.accumulate_matmuls)
        return fake_cuda_trace(plain_llama.make, jit=kforge.jit, size="micro", batch=2, seq=16)

    before, after = trace(False), trace(True)
    n_layers = sum(1 for b in after.backward.bound_symbols if b.sym.name == "kforge_swiglu_backward")
    assert n_layers >= 1
    assert [b.sym.name for b in before.backward.bound_symbols].count(ACC) == 0
    assert [b.sym.name for b in after.backward.bound_symbols].count(ACC) == 3 * n_layers
    fb, fa = _fusions(before.backward), _fusions(after.backward)
    assert len(fa) == len(fb) - 2 * n_layers, (len(fb), len(fa))
    assert len(_fusions(after.forward)) == len(_fusions(before.forward))
    for b in fa:  # no region adds matmul results any more
        assert not any(s.sym.name == "matmul" for s in b.subsymbols)


# ---- GPU: the kernels against eager PyTorch -----------------------------------------------------------
def _fusion_only():
    from kforge.fusion import get_fusion_executor

    return [get_fusion_executor()]


def _run_fused(fn: Callable, args: tuple, executors: list | None = None):
    import thunder

    jf = thunder.jit(fn, executors=executors or _fusion_only())
    out = jf(*args)
    return out, thunder.last_traces(jf)[-1]


def _layouts(args: tuple, layout: str) -> tuple:
    """The same values in another memory layout: transposed storage, or storage starting one
    element into its allocation (not 16-byte aligned)."""
    out = []
    for a in args:
        if layout == "contiguous" or a.dim() < 2:
            out.append(a)
        elif layout == "transposed":
            out.append(a.transpose(-1, -2).contiguous().transpose(-1, -2))
        elif layout == "offset":
            big = torch.empty(a.numel() + 1, dtype=a.dtype, device=a.device)
            v = big[1:].view(a.shape)
            v.copy_(a)
            out.append(v)
        else:
            raise ValueError(layout)
    return tuple(out)


@gpu
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "offset"])
@pytest.mark.parametrize("dtype", DTYPES3, ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernels_match_eager(case: str, dtype: torch.dtype, layout: str) -> None:
    fn, make = CASES[case]
    args = _layouts(make(dtype, "cuda"), layout)
    out, trace = _run_fused(fn, args)
    assert any(b.sym.name.startswith("kforgeFusion") for b in trace.bound_symbols), "nothing was fused"
    ref = _flat(fn(*args))
    for o, r in zip(_flat(out), ref):
        assert o.dtype == r.dtype and o.shape == r.shape
        assert_close(o, r, dtype if r.is_floating_point() else torch.float32, f"{case} {layout}", tol=TOL[dtype])


@gpu
@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(chains())
def test_generated_chains_on_gpu(chain) -> None:
    shape, dtype, n_in, steps, reduce_last = chain
    fn = _chain_fn(shape, steps, reduce_last, n_in)
    args = tuple(randn(*shape, dtype=dtype, seed=i) for i in range(n_in))
    out, _ = _run_fused(fn, args)
    for o, r in zip(_flat(out), _flat(fn(*args))):
        assert_close(o.float(), r.float(), torch.float32, "chain", tol=TOL[dtype] * 4)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,cols,dims", [(1, 1 << 20, (-1,)), (3, 70000, (-1,)), (9000, 7, (-1,)),
                                            (1 << 16, 64, (0,)), (5, 1 << 18, (0,)), (257, 33, (0, 1))])
def test_reduction_schedules(rows: int, cols: int, dims: tuple, dtype: torch.dtype) -> None:
    """Inner and outer reductions, split over the grid or not, against float64 sums."""
    x = randn(rows, cols, dtype=dtype)
    y = randn(rows, cols, dtype=dtype)

    def fn(a, b):
        p = a.float() * b.float()
        return p.sum(dims), p.amax(dims), torch.var_mean(p, dims, correction=0)

    out, trace = _run_fused(fn, (x, y))
    p64 = x.double() * y.double()
    s, m, (v, mu) = out
    # A sum of zero-mean products cancels: fp32's rounding is relative to the terms, not the sum
    # (a million of them sum to ~1e3 from ~6e5 of magnitude), so measure against sum |p|.
    terms = p64.abs().sum(dims)
    count = p64.numel() // terms.numel()
    assert_close(s, p64.sum(dims).float(), torch.float32, "sum", tol=2e-6, scale=terms.norm().item())
    assert torch.equal(m, (x.float() * y.float()).amax(dims)), "amax"
    assert_close(mu, p64.mean(dims).float(), torch.float32, "mean", tol=2e-6, scale=terms.norm().item() / count)
    assert_close(v, p64.var(dims, correction=0).float(), torch.float32, "var", tol=1e-4)
    # deterministic: the same bits again
    again = _run_fused(fn, (x, y))[0]
    assert all(torch.equal(a, b) for a, b in zip(_flat(out[:2]) + list(out[2]), _flat(again[:2]) + list(again[2])))


@gpu
def test_nan_and_inf_follow_torch() -> None:
    x = randn(4, 64)
    x[0, 3], x[1, 5], x[2, 7] = float("nan"), float("inf"), -float("inf")
    y = randn(4, 64)

    def fn(a, b):
        return torch.maximum(a, b) * 2, a.amax(-1), (a + b).sum(-1)

    out, _ = _run_fused(fn, (x, y))
    for o, r in zip(out, fn(x, y)):
        assert torch.equal(torch.isnan(o), torch.isnan(r)) and torch.equal(torch.isinf(o), torch.isinf(r))


@gpu
def test_streams_and_cuda_graphs() -> None:
    fn = CASES["rope"][0]
    args = CASES["rope"][1](torch.bfloat16, "cuda")
    import thunder

    jf = thunder.jit(fn, executors=_fusion_only())
    ref = fn(*args)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out = jf(*args)
    torch.cuda.synchronize()
    assert_close(out, ref, torch.bfloat16, "side stream")
    static = [a.clone() for a in args]
    jf(*static)  # warm up: compile and load outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gout = jf(*static)
    for a, b in zip(static, CASES["rope"][1](torch.bfloat16, "cuda")):
        a.copy_(b)
    g.replay()
    torch.cuda.synchronize()
    assert_close(gout, fn(*static), torch.bfloat16, "graph replay")


@gpu
@pytest.mark.bigmem
def test_past_2_31_elements() -> None:
    n = (1 << 31) + 24
    x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    x[-7:] = 3.0

    def fn(a):
        return a * 2 + 1

    out, _ = _run_fused(fn, (x,))
    assert out[0].item() == 3.0 and out[-1].item() == 7.0 and out[-8].item() == 3.0
    del out
    s, _ = _run_fused(lambda a: a.float().sum(), (x,))
    assert abs(s.item() - float(n - 7 + 21)) <= 1e-6 * n  # fp32 partial sums: a few ulps at 2^31


@gpu
@pytest.mark.parametrize("model", ["plain_llama", "nanogpt"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_users_models_tie_out(model: str, dtype: torch.dtype) -> None:
    """Loss and every gradient of a zoo model under kforge.jit (fusion on) against eager."""
    import copy
    import importlib

    import kforge

    make = importlib.import_module(f"kforge.zoo.{model}").make
    m, inputs, opts = make(size="micro", batch=2, seq=16, dtype=dtype)
    jm = kforge.jit(copy.deepcopy(m))
    ref_loss = opts["loss_fn"](m(*inputs))
    ref_loss.backward()
    loss = opts["loss_fn"](jm(*inputs))
    loss.backward()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert_close(loss.detach(), ref_loss.detach(), dtype, "loss", tol=tol)
    ref_grads = dict(m.named_parameters())
    for name, p in jm.named_parameters():
        assert_close(p.grad, ref_grads[name].grad, dtype, name, tol=tol * 5)


@gpu
@pytest.mark.parametrize("model", ["plain_llama", "hf_llama"])
def test_users_models_tie_out_under_autocast(model: str) -> None:
    """fp32 weights + bf16 autocast under kforge.jit / kforge.compile (the norms' bf16 outputs and
    residual-gradient adds in the norm kernels, kforge.fusion.norm_epilogues): loss and every gradient
    against eager's autocast step, both within bf16 error of the fp32 step."""
    import copy
    import importlib

    import kforge

    make = importlib.import_module(f"kforge.zoo.{model}").make
    m, inputs, opts = make(size="micro", batch=2, seq=16, autocast=True)
    mc = copy.deepcopy(m)
    jm = (kforge.compile if opts.get("mode") == "dynamo" else kforge.jit)(mc)
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (inputs, {})
    ref32 = copy.deepcopy(m)
    with torch.autocast("cuda", torch.bfloat16):
        ref_loss = opts["loss_fn"](m(*args, **kwargs))
        loss = opts["loss_fn"](jm(*args, **kwargs))
    ref_loss.backward()
    loss.backward()
    loss32 = opts["loss_fn"](ref32(*args, **kwargs))
    loss32.backward()
    assert_close(loss.detach(), ref_loss.detach(), torch.bfloat16, "loss vs eager autocast", tol=2e-2)
    ref_grads, grads32 = dict(m.named_parameters()), dict(ref32.named_parameters())
    for name, p in mc.named_parameters():
        assert p.grad.dtype == torch.float32, name
        assert_close(p.grad, ref_grads[name].grad, torch.bfloat16, f"{name} vs eager autocast", tol=0.1)
        assert_close(p.grad, grads32[name].grad, torch.bfloat16, f"{name} vs fp32", tol=0.1)


@gpu
@pytest.mark.parametrize("model", ["plain_llama", "nanogpt"])
def test_cuda_graph_transform(model: str) -> None:
    """kforge.jit with Thunder's CUDAGraphTransform: fusions and kforge ops captured, replays match eager
    over several steps of new inputs."""
    import copy
    import importlib

    from thunder.transforms.cudagraph import CUDAGraphTransform

    import kforge

    make = importlib.import_module(f"kforge.zoo.{model}").make
    m, inputs, opts = make(size="micro", batch=2, seq=16, dtype=torch.float32)
    jm = kforge.jit(copy.deepcopy(m), transforms=[CUDAGraphTransform()])
    for step in range(3):
        _, new_inputs, _ = make(size="micro", batch=2, seq=16, dtype=torch.float32, seed=step + 1)
        ref = opts["loss_fn"](m(*new_inputs))
        out = opts["loss_fn"](jm(*new_inputs))
        assert_close(out.detach(), ref.detach(), torch.float32, f"step {step}", tol=1e-4)
        ref.backward()
        out.backward()
    grads = dict(m.named_parameters())
    for name, p in jm.named_parameters():
        assert_close(p.grad, grads[name].grad, torch.float32, name, tol=1e-3)


@gpu
def test_pass_through_outputs_on_gpu() -> None:
    """A cast round trip returns its input tensor itself; two outputs of one value share one tensor;
    values against a float64 reference."""
    def fn(x, y):
        r = x.float().to(torch.bfloat16)
        w = (r + y).float()
        return r, w.to(torch.bfloat16), w.to(torch.bfloat16)

    x, y = (randn(64, 96, dtype=torch.bfloat16, seed=i) for i in range(2))
    (r, a, b), trace = _run_fused(fn, (x, y))
    assert r is x or r.data_ptr() == x.data_ptr()
    assert a.data_ptr() == b.data_ptr()
    assert_close(a, (x.double() + y.double()).to(torch.bfloat16), torch.bfloat16, "add")


@gpu
@pytest.mark.parametrize("physical", ["token_major", "head_major", "offset"])
def test_movement_region_view_or_copy(physical: str) -> None:
    """(B, H, T, D) -> (B, T, H * D): a view of a token-major input (no kernel, storage shared), a
    copy kernel of a head-major one; the same values either way."""
    B, H, T, D = 2, 4, 32, 16
    base = randn(B, T, H, D, dtype=torch.bfloat16)
    if physical == "token_major":
        x = base.transpose(1, 2)                   # BTHD in memory, (B, H, T, D) logically
    elif physical == "head_major":
        x = base.transpose(1, 2).contiguous()
    else:
        big = torch.empty(base.numel() + 8, dtype=base.dtype, device=base.device)
        big[8:].view(B, T, H, D).copy_(base)
        x = big[8:].view(B, T, H, D).transpose(1, 2)
    fn = lambda g: g.transpose(1, 2).reshape(B, T, H * D)  # noqa: E731
    out, trace = _run_fused(fn, (x,))
    assert any(b.sym.name.startswith("kforgeFusion") for b in trace.bound_symbols), "nothing was fused"
    assert torch.equal(out, fn(x).clone()) and torch.equal(out.double(), base.double().reshape(B, T, H * D))
    shares = out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert shares == (physical != "head_major"), physical


@gpu
@pytest.mark.parametrize("case,shares", [("transpose_view", True), ("transpose_copy", False),
                                         ("plain_view", True), ("plain_copy", False)])
def test_contiguous_output_is_contiguous(case: str, shares: bool) -> None:
    """`.contiguous()` of a movement-only region: a view where that view is contiguous (as torch
    returns self), else a copy kernel; contiguous and equal to torch's either way."""
    B, H, T, D = 2, 4, 32, 16
    base = randn(B, T, H, D, dtype=torch.bfloat16)
    # transpose_*: (B, T, H, D) -> (B, H, T, D), contiguous in memory only when the input is BHTD.
    x = base.transpose(1, 2) if case in ("transpose_view", "plain_copy") else base
    if case.startswith("transpose"):
        fn = lambda g: g.transpose(1, 2).contiguous()  # noqa: E731
    else:
        fn = lambda g: g.contiguous()  # noqa: E731
    out, trace = _run_fused(fn, (x,))
    assert out.is_contiguous() and torch.equal(out, fn(x)), case
    assert (out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()) == shares, case


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 16, 64), (1, 5, 7, 24), (2, 2, 3, 8)], ids=str)
def test_rope_bitwise_equals_eager(shape: tuple, dtype: torch.dtype) -> None:
    """The generated RoPE rounds where eager PyTorch rounds (each product and the sum; the negation
    is exact), so the two agree bit for bit."""
    b, h, t, d = shape
    args = (randn(b, h, t, d, dtype=dtype, seed=1), randn(t, d, dtype=dtype, seed=2), randn(t, d, dtype=dtype, seed=3))
    out, trace = _run_fused(_rope, args)
    assert any(b_.sym.name.startswith("kforgeFusion") for b_ in trace.bound_symbols), "nothing was fused"
    assert torch.equal(out, _rope(*args))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matmul_accumulation_on_gpu(dtype: torch.dtype) -> None:
    """The addmm chain through thunder.jit with kforge's executors against a float64 reference."""
    import thunder

    import kforge

    args = tuple(randn(*s, dtype=dtype, seed=i)
                 for i, s in enumerate([(512, 64), (64, 256), (512, 64), (64, 256), (512, 256), (256, 256)]))
    jf = thunder.jit(_matmul_sum, executors=kforge.executors())
    out = jf(*args)
    names = [b.sym.name for b in thunder.last_traces(jf)[-1].bound_symbols]
    assert names.count(ACC) == 2, names
    ref = _matmul_sum(*(a.double() for a in args))
    assert_close(out, ref.to(dtype), dtype, "addmm chain")


# ---- GPU: determinism and NaN / inf patterns of the generated kernels (issue 20) ---------------------
def _fused_symbols(trace) -> list[str]:
    return [b.sym.name for b in trace.bound_symbols if b.sym.name.startswith("kforgeFusion")]


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,dim", [((65536, 7), 0), ((7, 65536), -1), ((3, 5, 33), (0, 1))],
                         ids=["outer-split", "inner-split", "small"])
def test_generated_kernels_are_deterministic(shape: tuple, dim, dtype: torch.dtype) -> None:
    """The same inputs give the same bits in 3 runs: an elementwise chain and sum / amax / mean / var
    reductions, among them a split one (few output lanes, many reduced rows: the grid splits the rows
    and the partials are combined). Fails if partials are combined in a run-dependent order (atomics,
    or a schedule that depends on timing) or an output element is left unwritten (poisoned NaN)."""
    x, y = randn(*shape, dtype=dtype, seed=3), randn(*shape, dtype=dtype, seed=4)

    def fn(a, b):
        p = a.float() * b.float() + 0.25
        return torch.sin(a) * b, p.sum(dim), p.amax(dim), p.mean(dim), torch.var(p, dim, correction=0)

    import thunder

    jf = thunder.jit(fn, executors=_fusion_only())
    runs = [_flat(jf(x, y)) for _ in range(3)]
    assert _fused_symbols(thunder.last_traces(jf)[-1]), "nothing was fused"
    for k, (out, ref) in enumerate(zip(runs[0], _flat(fn(x, y)))):
        assert torch.isfinite(out).all(), f"output {k}: non-finite (unwritten?)"
        assert out.shape == ref.shape and out.dtype == ref.dtype, k
    for run in runs[1:]:
        for k, (a, b) in enumerate(zip(runs[0], run)):
            assert torch.equal(a, b), f"output {k} differs between runs"


def _nan_inf_lanes(shape: tuple, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values with, per output lane of a reduction over `dim` (lane j: index j of the other dim),
    a pattern placed at the start, the middle and the end of the reduced dim (different chunks of a
    split reduction): 0 one NaN, 1 one +inf, 2 +inf and -inf, 3 all -inf, 4 NaN and +inf, 5 finite,
    6 one -inf."""
    x = randn(*shape, dtype=dtype, seed=seed)
    lanes = x.movedim(dim, -1)  # a view: (lanes, reduced)
    n = lanes.shape[-1]
    nan, inf = float("nan"), float("inf")
    lanes[0, n // 2] = nan
    lanes[1, n - 1] = inf
    lanes[2, 0], lanes[2, n - 1] = inf, -inf
    lanes[3, :] = -inf
    lanes[4, 0], lanes[4, n // 2] = nan, inf
    lanes[6, n // 2] = -inf
    return x


def _assert_same_pattern(out: torch.Tensor, ref: torch.Tensor, what: str, tol: float,
                         scale: float | None = None) -> None:
    """NaN, +inf and -inf exactly where torch has them; the finite elements close."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, what
    for name, f in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        got, want = f(out), f(ref)
        assert torch.equal(got, want), f"{what}: {name} at {got.nonzero().tolist()}, torch {want.nonzero().tolist()}"
    fin = torch.isfinite(ref)
    if fin.any():
        assert_close(out[fin].float(), ref[fin].float(), torch.float32, what, tol=tol, scale=scale)


@gpu
@pytest.mark.parametrize("dtype", DTYPES3, ids=str)
@pytest.mark.parametrize("shape,dim", [((7, 64), -1), ((7, 65536), -1), ((65536, 7), 0)],
                         ids=["small", "inner-split", "outer-split"])
def test_nan_and_inf_patterns_follow_torch(shape: tuple, dim: int, dtype: torch.dtype) -> None:
    """NaN / +inf / -inf inputs (placed in every lane pattern `_nan_inf_lanes` lists) through an
    elementwise chain (maximum / minimum / where / clamp / relu propagate or drop NaN as torch does;
    x / 0, log of negatives and of 0, exp of inf) and through sum / amax / amin / mean, inner, outer and
    split: the outputs have NaN, +inf and -inf exactly where torch's have them. Fails if a kernel uses
    fmaxf-style NaN dropping in amax / maximum, loses a NaN in a split's combine, or turns inf - inf
    into something other than NaN."""
    x = _nan_inf_lanes(shape, dim, dtype, seed=5)
    y = randn(*shape, dtype=dtype, seed=6)
    y.view(-1)[::5] = 0.0  # x / 0: +-inf, 0 / 0 and NaN / 0: NaN

    def elementwise(a, b):
        return (torch.maximum(a, b) * 2 - torch.minimum(a, 0.5 * b), a / b, torch.log(a), torch.exp(a),
                torch.where(a > b, a, b), torch.clamp(a, -1.0, 1.0), torch.relu(a) + b)

    def reductions(a):
        p = a.float()
        return p.sum(dim), p.amax(dim), p.amin(dim), p.mean(dim), a.amax(dim)

    out, trace = _run_fused(elementwise, (x, y))
    assert _fused_symbols(trace), "elementwise: nothing was fused"
    for k, (o, r) in enumerate(zip(_flat(out), _flat(elementwise(x, y)))):
        _assert_same_pattern(o, r, f"elementwise output {k} {dtype}", tol=TOL[dtype] * 4)
    out, trace = _run_fused(reductions, (x,))
    assert _fused_symbols(trace), "reductions: nothing was fused"
    # Sums cancel: fp32's rounding is relative to the terms (sum |p| of the finite ones), not to the
    # sum; amax / amin are exact.
    terms = x.float().abs().nan_to_num(posinf=0.0, neginf=0.0).sum(dim).norm().item()
    checks = [("sum", 2e-6, terms), ("amax", 0.0, None), ("amin", 0.0, None),
              ("mean", 2e-6, terms / x.shape[dim]), (f"amax {dtype}", 0.0, None)]
    for o, r, (name, tol, scale) in zip(_flat(out), _flat(reductions(x)), checks):
        _assert_same_pattern(o, r, f"{name} over {dim} of {shape}", tol=tol, scale=scale)



def _norm_then_more(fold: bool, dtype: torch.dtype, monkeypatch) -> tuple:
    """out = rms_norm(x) * u + x @ m under kforge.jit: x's gradient is the norm's dx plus g @ m^T (a
    stored matmul result, as a residual's gradient is: a term computed in the add's own kernel could
    be contracted into an FMA there), added by an add kernel or (fold) by the norm's backward.
    Returns (out, grads, backward symbols)."""
    import thunder

    import kforge
    from kforge.fusion import executor as fusion_executor

    monkeypatch.setenv("KFORGE_TRACE_CACHE", "0")  # traced here, not restored from disk
    if not fold:
        monkeypatch.setattr(fusion_executor, "fold_residual_grads", lambda bsyms, *a, **k: (list(bsyms), 0))
    rows, d = 1037, 768  # odd row count; many blocks
    x = randn(rows, d, dtype=dtype, seed=11).requires_grad_()
    w = (1 + 0.1 * randn(d, dtype=dtype, seed=12)).requires_grad_()
    u = randn(rows, d, dtype=dtype, seed=13)
    g = randn(rows, d, dtype=dtype, seed=14)
    m = randn(d, d, dtype=dtype, seed=15, scale=d ** -0.5)

    def fn(x, w, u, m):
        return F.rms_norm(x, (d,), w, 1e-5) * u + x @ m

    jf = kforge.jit(fn)
    out = jf(x, w, u, m)
    out.backward(g)
    names = [b.sym.name for b in thunder.last_backward_traces(jf)[-1].bound_symbols]
    return out.detach(), (x.grad, w.grad), names


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_residual_gradient_added_by_the_norm_backward(monkeypatch, dtype: torch.dtype) -> None:
    """The fusion pass hands the add of a norm input's other gradient to the RMSNorm backward kernel
    (kforge.fusion.norm_epilogues). fp32 (autocast's residual stream): within an ulp of the separate
    add (the kernel may fuse the last multiply and the add). bf16: one rounding where the add kernel
    rounded dx first. Both within the dtype's rounding of float64."""
    with monkeypatch.context() as m:
        out0, (dx0, dw0), names0 = _norm_then_more(False, dtype, m)
    with monkeypatch.context() as m:
        out1, (dx1, dw1), names1 = _norm_then_more(True, dtype, m)
    assert "kforge_rmsnorm_backward" in names0 and "kforge_add_rmsnorm_backward" not in names0, names0
    assert "kforge_add_rmsnorm_backward" in names1 and "kforge_rmsnorm_backward" not in names1, names1
    assert torch.equal(out0, out1) and torch.equal(dw0, dw1)
    if dtype == torch.float32:  # the kernel's r * (...) + dres may contract to one FMA: an ulp at most
        assert_close(dx1, dx0, dtype, "dx folded vs add kernel", tol=1e-6)
    x = randn(1037, 768, dtype=dtype, seed=11).double().requires_grad_()
    w = (1 + 0.1 * randn(768, dtype=dtype, seed=12)).double()
    u, g = randn(1037, 768, dtype=dtype, seed=13).double(), randn(1037, 768, dtype=dtype, seed=14).double()
    m = randn(768, 768, dtype=dtype, seed=15, scale=768 ** -0.5).double()
    (F.rms_norm(x, (768,), w, 1e-5) * u + x @ m).backward(g)
    assert_close(dx1, x.grad.to(dtype), dtype, "dx (folded)")
