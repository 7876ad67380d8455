"""What `python -m kforge.bench ops --op fusion` times: generated kernels of typical regions against
eager PyTorch and torch.compile, in GB/s against the measured copy bandwidth.

Each case is a torch function jitted by Thunder with kforge's fusion executor alone; the timed call
is the region's GeneratedKernel itself (what a Thunder trace calls), so the numbers are the kernels'.
"""
from __future__ import annotations


from typing import Callable

import torch
import torch.nn.functional as F


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _silu_mul(a, b):
    return F.silu(a) * b


def _add(a, b):
    return a + b


def _bias_grad(g):
    return g.float().sum(0).to(g.dtype)


def _residual_bias_grad(a, b):
    """A GPT-2 backward under autocast: the fp32 residual gradient, its bf16 copy and the bias sum."""
    s = a + b
    h = s.to(torch.bfloat16)
    return s, h, h.float().sum((0, 1))


def _sum_sq_rows(x):
    return (x.float() * x.float()).sum(-1)


def _heads_to_tokens(x):
    return x.transpose(1, 2).contiguous()


def _region_kernel(fn: Callable, args: tuple) -> tuple[Callable, list[int]]:
    """(the GeneratedKernel of `fn`'s single region, built with Thunder on `args`; the positions in
    `args` of the kernel's tensor arguments, in the kernel's order)."""
    import thunder
    from thunder.core.proxies import TensorProxy

    from . import get_fusion_executor

    jf = thunder.jit(fn, executors=[get_fusion_executor()])
    jf(*args)
    trace = thunder.last_traces(jf)[-1]
    fusions = [b for b in trace.bound_symbols if b.sym.is_fusion]
    if len(fusions) != 1:
        raise AssertionError(f"expected one region, got {len(fusions)}")
    b = fusions[0]
    names = [a.name for a in trace.args]
    return b._call_ctx[b.sym.name], [names.index(a.name) for a in b.args if isinstance(a, TensorProxy)]


def bench_cases(dtype: torch.dtype, quick: bool) -> list:
    from ..bench.cases import BenchCase

    es = torch.tensor([], dtype=dtype).element_size()
    cases = []

    def add(name: str, shape: str, fn: Callable, make: Callable[[], tuple], nbytes: int, direction: str = "fwd"):
        holder: dict = {}

        def kforge(*xs):
            if "k" not in holder:
                holder["k"], holder["order"] = _region_kernel(fn, xs)
            return holder["k"](*(xs[i] for i in holder["order"]))

        cases.append(BenchCase(f"fusion.{name}", direction, shape, make, kforge=kforge, eager=fn, bytes=nbytes))

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype)

    b, h, t, d = 8, 12, 1024, 64
    n = b * h * t * d
    add("rope", f"{b}x{h}x{t}x{d}", _rope, lambda: (rnd(b, h, t, d), rnd(t, d), rnd(t, d)), (2 * n + 2 * t * d) * es)
    rows, ffn = 8192, 2048 if quick else 14336
    add("silu_mul", f"{rows}x{ffn}", _silu_mul, lambda: (rnd(rows, ffn), rnd(rows, ffn)), 3 * rows * ffn * es)
    add("add", f"{rows}x768", _add, lambda: (rnd(rows, 768), rnd(rows, 768)), 3 * rows * 768 * es)
    add("bias_grad", f"{rows}x3072", _bias_grad, lambda: (rnd(rows, 3072),), (rows + 1) * 3072 * es, "reduce")
    if not quick:
        # The same regions at a size where a plain copy reaches its peak (a Llama-7B layer's RoPE at
        # T = 2048; a 32k-token bias gradient): the model-size rows above include launch ramp and tail.
        bl, hl, tl, dl = 8, 32, 2048, 128
        nl = bl * hl * tl * dl
        add("rope", f"{bl}x{hl}x{tl}x{dl}", _rope, lambda: (rnd(bl, hl, tl, dl), rnd(tl, dl), rnd(tl, dl)),
            (2 * nl + 2 * tl * dl) * es)
        add("bias_grad", "32768x4096", _bias_grad, lambda: (rnd(32768, 4096),), (32768 + 1) * 4096 * es, "reduce")
    if dtype == torch.float32:
        add("residual_bias_grad", "8x1024x768", _residual_bias_grad, lambda: (rnd(8, 1024, 768), rnd(8, 1024, 768)),
            8 * 1024 * 768 * (4 * 3 + 2) + 768 * 4, "reduce")
    add("sum_sq_rows", f"{rows}x4096", _sum_sq_rows, lambda: (rnd(rows, 4096),), rows * 4096 * es + rows * 4, "reduce")
    add("heads_to_tokens", f"{b}x{h}x{t}x{d}", _heads_to_tokens, lambda: (rnd(b, h, t, d),), 2 * n * es)
    return cases


def launch_callables() -> list[tuple[str, Callable[[], object]]]:
    """(name, call) pairs for `bench launch`: a generated kernel called as a Thunder trace calls a
    region (the kernel object itself, arguments in its order), beside torch.add on the same 1024
    elements."""
    x, y = torch.randn(1024, device="cuda"), torch.randn(1024, device="cuda")
    k, order = _region_kernel(_add, (x, y))
    a, b = ((x, y)[i] for i in order)
    return [("kforge.fusion GeneratedKernel (a + b)", lambda: k(a, b)), ("torch.add", lambda: torch.add(x, y))]
