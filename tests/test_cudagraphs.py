"""kforge.cudagraphs: Thunder's CUDA-graph transform with a runner that hands gradients out without a
copy, moves what a holder keeps before the graph overwrites it, and checks arguments one by one.

CPU: the runner's bookkeeping with a stand-in graph (its replay recomputes the region into the same
output tensors, as a captured graph writes the same addresses) inside a real autograd backward, so
AccumulateGrad takes or copies gradients as it does on a GPU; which graphs alias their outputs on a
Llama traced as on a GPU. GPU: training steps under CUDA graphs against
the same model without them, gradient accumulation, a kept view of a gradient.
"""
from __future__ import annotations

import copy

import pytest
import torch

from conftest import fake_cuda_trace, gpu
from kforge.cudagraphs import CUDAGraphs, GraphRunner


class StandInGraph:
    """Replays `fn` on the captured inputs into the captured outputs' memory."""

    def __init__(self, fn, inputs, outputs):
        self.fn, self.inputs, self.outputs = fn, inputs, outputs
        self.replays = 0

    def replay(self):
        self.replays += 1
        fresh = self.fn(*self.inputs)
        for o, f in zip(self.outputs, fresh):
            if o is not f:  # an input passed through is no write
                o.copy_(f)


class StandInRunner(GraphRunner):
    def build_cuda_graph(self, fn, args, static_args_mask):
        inputs = tuple(a if s else (a.clone() if isinstance(a, torch.Tensor) else a)
                       for a, s in zip(args, static_args_mask))
        outputs = fn(*inputs)
        return StandInGraph(fn, inputs, outputs), inputs, outputs


def region(w, x, scale):
    """A backward-like region: two gradients from a weight, an input and a number."""
    return [x * w * scale, (x * x).sum(0) * scale]


def runner_with_region(alias: bool = True):
    r = StandInRunner()
    r.python_callables["CUDAGraph1"] = (region, (True, False, False))
    if alias:
        r.alias_names.add("CUDAGraph1")
    return r


class Backward(torch.autograd.Function):
    """An op whose backward is the runner's region: its gradients reach AccumulateGrad as they
    would from Thunder's backward."""

    @staticmethod
    def forward(ctx, runner, w, b, x):
        ctx.runner, ctx.w, ctx.x = runner, w.detach(), x
        return (w * x).sum() + b.sum()

    @staticmethod
    def backward(ctx, g):
        gw, gb = ctx.runner.call_cuda_graph("CUDAGraph1", ctx.w, ctx.x, float(g))
        return None, gw, gb, None


def params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(5, 3, generator=gen) + 0.5)
    b = torch.nn.Parameter(torch.randn(3, generator=gen))
    return w, b


def step(runner, w, b, x):
    Backward.apply(runner, w, b, x).backward()


def expected(w, xs):
    gw = sum(x * w.detach() for x in xs)
    gb = sum((x * x).sum(0) for x in xs)
    return gw, gb


def test_gradients_are_taken_without_a_copy():
    r = runner_with_region()
    w, b = params()
    for i in range(4):
        x = torch.randn(5, 3) + i
        w.grad = b.grad = None  # zero_grad(set_to_none=True)
        step(r, w, b, x)
        gw, gb = expected(w, [x])
        torch.testing.assert_close(w.grad, gw)
        torch.testing.assert_close(b.grad, gb)
        h = r._last["CUDAGraph1"]
        # AccumulateGrad took the alias: the gradient lives in the graph's output buffer
        assert w.grad.data_ptr() == h.outputs[0].data_ptr() and b.grad.data_ptr() == h.outputs[1].data_ptr()
    # the first call captures, then replays, as every call does
    assert r.stats == {"replays": 4, "retired": 0, "slow_lookups": 1}, r.stats


def test_thunders_way_hands_out_the_buffers_and_autograd_copies_them():
    """The behaviour kforge's runner removes: without aliases, AccumulateGrad clones each gradient."""
    r = runner_with_region(alias=False)
    w, b = params()
    step(r, w, b, torch.randn(5, 3))
    step(r, w, b, torch.randn(5, 3))  # replays (the first call captured)
    h = r._last["CUDAGraph1"]
    assert w.grad.data_ptr() != h.outputs[0].data_ptr()


@pytest.mark.parametrize("calls", [2, 3])
def test_accumulated_gradients_are_never_overwritten(calls: int):
    """No zero_grad between backward passes: param.grad is the last call's buffer, so the graph is
    retired (its buffers left to param.grad) and a new one hands out its buffers, which AccumulateGrad
    adds in place; the sums are right."""
    r = runner_with_region()
    w, b = params()
    xs = [torch.randn(5, 3) * (i + 1) for i in range(calls)]
    for x in xs:
        step(r, w, b, x)
    gw, gb = expected(w, xs)
    torch.testing.assert_close(w.grad, gw)
    torch.testing.assert_close(b.grad, gb)
    assert r.stats["retired"] == 1 and "CUDAGraph1" not in r.alias_names, r.stats
    # later steps (zeroed to None) replay the new graph without retiring it again
    w.grad = b.grad = None
    x = torch.randn(5, 3)
    step(r, w, b, x)
    gw, gb = expected(w, [x])
    torch.testing.assert_close(w.grad, gw)
    assert r.stats["retired"] == 1, r.stats


def test_zeroed_in_place_gradients_stay_right():
    """zero_grad(set_to_none=False) keeps param.grad (the buffer), zeroed: the next backward's sum is
    its gradient alone."""
    r = runner_with_region()
    w, b = params()
    step(r, w, b, torch.randn(5, 3))
    for _ in range(2):
        w.grad.zero_()
        b.grad.zero_()
        x = torch.randn(5, 3)
        step(r, w, b, x)
        gw, gb = expected(w, [x])
        torch.testing.assert_close(w.grad, gw)
        torch.testing.assert_close(b.grad, gb)


def test_a_kept_view_of_a_gradient_is_never_overwritten():
    """A view of last step's gradient that the user keeps holds the buffer's storage: the graph is
    retired, and the view keeps its values."""
    r = runner_with_region()
    w, b = params()
    step(r, w, b, torch.randn(5, 3))
    w.grad = b.grad = None
    step(r, w, b, torch.randn(5, 3))
    kept = w.grad[1:3]
    kept_values = kept.clone()
    w.grad = b.grad = None
    x = torch.randn(5, 3) + 7
    step(r, w, b, x)
    torch.testing.assert_close(kept, kept_values, rtol=0, atol=0)
    gw, gb = expected(w, [x])
    torch.testing.assert_close(w.grad, gw)
    torch.testing.assert_close(b.grad, gb)
    assert r.stats["retired"] == 1, r.stats
    w.grad = b.grad = None
    step(r, w, b, torch.randn(5, 3) - 3)
    torch.testing.assert_close(kept, kept_values, rtol=0, atol=0)
    assert r.stats["retired"] == 1 and r.stats["replays"] == 4, r.stats


def test_arguments_checked_one_by_one_and_a_new_layout_builds_a_new_graph():
    r = runner_with_region(alias=False)
    w, _ = params()
    x = torch.randn(5, 3)
    first = r.call_cuda_graph("CUDAGraph1", w, x, 1.0)
    again = r.call_cuda_graph("CUDAGraph1", w, x + 1, 1.0)
    assert again[0] is first[0]  # Thunder's way for graphs that do not alias: the buffer itself
    torch.testing.assert_close(again[0], (x + 1) * w.detach())
    assert r.stats["slow_lookups"] == 1
    xt = torch.randn(3, 5).t()  # same shape, other strides: another graph
    out = r.call_cuda_graph("CUDAGraph1", w, xt, 2.0)
    torch.testing.assert_close(out[0], xt * w.detach() * 2.0)
    assert r.stats["slow_lookups"] == 2 and len(r.cuda_graph_cache) == 2
    out = r.call_cuda_graph("CUDAGraph1", w, x, 3.0)  # a different number: Thunder's key has it too
    torch.testing.assert_close(out[0], x * w.detach() * 3.0)
    assert r.stats["slow_lookups"] == 3 and len(r.cuda_graph_cache) == 3


def test_pass_through_outputs_are_not_aliased():
    """An output that is an input (a parameter passed through) is not the graph's memory."""
    r = StandInRunner()
    r.python_callables["CUDAGraph1"] = (lambda w, x: [w, x * 2], (True, False))
    r.alias_names.add("CUDAGraph1")
    w, _ = params()
    r.call_cuda_graph("CUDAGraph1", w, torch.randn(5, 3))
    out = r.call_cuda_graph("CUDAGraph1", w, torch.randn(5, 3))
    assert out[0] is w and r._last["CUDAGraph1"].aliased == (False, True)


def test_backward_graphs_alias_forward_graphs_do_not():
    """On a Llama traced as on a GPU, the graphs of the backward trace hand out aliases; the forward's
    outputs stay Thunder's (the backward uses the saved ones in place)."""
    import kforge
    from kforge.zoo import plain_llama

    holder = {}

    def jit(fn):
        jfn = kforge.jit(fn, cudagraphs=True)
        import thunder

        (t,) = [t for t in thunder.compile_data(jfn).transforms if isinstance(t, CUDAGraphs)]
        holder["t"] = t
        return jfn

    ft = fake_cuda_trace(plain_llama.make, jit=jit, size="micro", batch=2, seq=16)
    runner = holder["t"].runner
    fwd = {b.sym.name for b in ft.forward.bound_symbols if b.sym.name.startswith("CUDAGraph")}
    bwd = {b.sym.name for b in ft.backward.bound_symbols if b.sym.name.startswith("CUDAGraph")}
    assert fwd and bwd and not fwd & bwd
    assert runner.alias_names == bwd


def test_jit_cudagraphs_argument():
    import thunder
    from thunder.transforms.cudagraph import CUDAGraphTransform

    import kforge

    m = torch.nn.Linear(4, 4)
    assert any(isinstance(t, CUDAGraphs) for t in thunder.compile_data(kforge.jit(m, cudagraphs=True)).transforms)
    assert not any(isinstance(t, CUDAGraphTransform) for t in thunder.compile_data(kforge.jit(m)).transforms)
    mine = CUDAGraphTransform()
    ts = thunder.compile_data(kforge.jit(m, cudagraphs=True, transforms=[mine])).transforms
    assert sum(isinstance(t, CUDAGraphTransform) for t in ts) == 1  # the one given is kept, none added
    with pytest.raises(TypeError, match="kforge.jit: cudagraphs must be True or False"):
        kforge.jit(m, cudagraphs="yes")
    with pytest.raises(TypeError, match="kforge.compile: cudagraphs must be True or False"):
        kforge.compile(m, cudagraphs=1)


# ---- GPU -----------------------------------------------------------------------------------------
def _graph_runner(jm) -> GraphRunner:
    import thunder

    (t,) = [t for t in thunder.compile_data(jm).transforms if isinstance(t, CUDAGraphs)]
    return t.runner


@gpu
@pytest.mark.parametrize("model", ["plain_llama", "nanogpt"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_under_graphs_matches_without(model: str, dtype: torch.dtype) -> None:
    """Five AdamW steps on new inputs with kforge.jit(cudagraphs=True) against kforge.jit: the same
    kernels, so losses and weights agree to rounding of the reduction order (none expected); the
    gradients were taken from the graph's buffers (no graph retired)."""
    import importlib

    import kforge

    make = importlib.import_module(f"kforge.zoo.{model}").make
    m, _, opts = make(size="micro", batch=2, seq=16, dtype=dtype)
    plain, graphed = kforge.jit(copy.deepcopy(m)), kforge.jit(copy.deepcopy(m), cudagraphs=True)
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    opt_g = torch.optim.AdamW(graphed.parameters(), lr=1e-3, fused=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for s in range(5):
        _, inputs, _ = make(size="micro", batch=2, seq=16, dtype=dtype, seed=s + 1)
        losses = []
        for fn, opt in ((plain, opt_p), (graphed, opt_g)):
            opt.zero_grad(set_to_none=True)
            loss = opts["loss_fn"](fn(*inputs))
            loss.backward()
            losses.append(loss.detach().float().item())
            opt.step()
        assert losses[0] == pytest.approx(losses[1], rel=tol, abs=tol), (s, losses)
    for (name, p), q in zip(plain.named_parameters(), graphed.parameters()):
        torch.testing.assert_close(q, p, rtol=tol, atol=tol, msg=name)
    st = _graph_runner(graphed).stats
    assert st["replays"] >= 8 and st["retired"] == 0, st


@gpu
def test_gradient_accumulation_and_kept_views_under_graphs() -> None:
    """Four backward passes without zero_grad in between, then a view of a gradient kept across a
    step: gradients equal to the run without graphs; the kept view is untouched."""
    import kforge
    from kforge.zoo import plain_llama

    m, _, opts = plain_llama.make(size="micro", batch=2, seq=16, dtype=torch.float32)
    plain, graphed = kforge.jit(copy.deepcopy(m)), kforge.jit(copy.deepcopy(m), cudagraphs=True)
    batches = [plain_llama.make(size="micro", batch=2, seq=16, dtype=torch.float32, seed=s + 1)[1]
               for s in range(4)]
    for fn in (plain, graphed):
        for inputs in batches:
            opts["loss_fn"](fn(*inputs)).backward()
    for (name, p), q in zip(plain.named_parameters(), graphed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)
    runner = _graph_runner(graphed)
    assert runner.stats["retired"] == 1, runner.stats
    w = next(graphed.parameters())
    kept = w.grad.view(-1)[:7]
    kept_values = kept.clone()
    for p in graphed.parameters():
        p.grad = None
    opts["loss_fn"](graphed(*batches[0])).backward()
    torch.cuda.synchronize()
    torch.testing.assert_close(kept, kept_values, rtol=0, atol=0)

