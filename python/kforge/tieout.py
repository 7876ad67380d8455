"""Tie-out: prove that a model compiled with Thunder + kforge computes what eager PyTorch computes.

`tieout(model, inputs)` makes two copies of the model with identical weights, runs one eagerly and
one through `thunder.jit` (or Thunder's Dynamo path, `mode="dynamo"`) with
`executors=[kforge.executor, *thunder.get_default_executors()]`, backpropagates the same loss through
both, and compares every output, the loss, every parameter gradient (and the gradient of any input
that requires one). Each comparison is a row of a `TieoutReport`: max |compiled - eager|, the
relative error ||compiled - eager|| / ||eager||, the tolerance and whether it passed.

`loss_curves(model, inputs, steps=10)` trains both copies for a few AdamW steps on the same batch and
returns the two loss curves.

Tolerances (`TOLERANCES`, keyed by the eager tensor's dtype). A row passes when
    ||a - b|| / ||b|| <= rel    and    max|a - b| <= elem * max|b|
with a = compiled, b = eager. Both are approximations of the exact result, so they may differ by
the sum of their errors. Measured (CPU) on the 2-layer GPT-2 of the tests (C=192, T=64, vocab 50257
and 997, manual and SDPA attention, LayerNorm and bias parameters randomised), eager against a
float64 copy of the same rounded weights is at worst
    fp32: rel 8e-7, elem 1.1e-6   (unit roundoff 6e-8, amplified through the network)
    bf16: rel 1.9e-2, elem 4.0e-2 (unit roundoff 2^-9 = 2e-3; worst are the LayerNorm weight/bias
          gradients: reductions over B*T rows of bf16-rounded upstream gradients)
bf16 bounds are twice eager's worst error: kforge may be as inaccurate as eager, not more (a CPU dry
run of the kforge graph with fp32-math reference launchers came to rel 2.1e-2, elem 5e-2 against
eager). fp32 bounds are ~100x eager's error, room for other reduction orders and deeper models, yet
20x below one bf16-sized rounding (2e-3), so an fp32 tie-out catches a kernel that rounds to bf16
internally. fp16 has 8x bf16's precision; fp64 and integer outputs must agree (near-)exactly. TF32
is switched off during a tie-out: its 2^-11 rounding would swamp the fp32 bounds.
"""
from __future__ import annotations

import contextlib
import copy
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal, Mapping, NamedTuple, Sequence

import torch
import torch.nn as nn

Mode = Literal["jit", "dynamo"]


@dataclass(frozen=True)
class Tolerance:
    """Bounds for one comparison of a (compiled) against b (eager):
    rel:  ||a - b|| / ||b|| <= rel      (the whole tensor, float64 norms)
    elem: max|a - b| <= elem * max|b|   (catches a few wrong elements that a norm would average away)
    """

    rel: float
    elem: float


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(rel=1e-4, elem=1e-4),
    torch.bfloat16: Tolerance(rel=4e-2, elem=8e-2),
    torch.float16: Tolerance(rel=5e-3, elem=1e-2),
    torch.float64: Tolerance(rel=1e-9, elem=1e-9),
}
_EXACT = Tolerance(rel=0.0, elem=0.0)  # integer / bool outputs


Tolerances = Tolerance | Mapping[torch.dtype, Tolerance]


def tolerance_for(dtype: torch.dtype, tolerances: Tolerances | None = None) -> Tolerance:
    """The tolerance for a tensor of `dtype`: `tolerances` when it is one Tolerance, else its entry
    for `dtype`, else TOLERANCES' (exact for non-float dtypes)."""
    if isinstance(tolerances, Tolerance):
        return tolerances
    if tolerances is not None and dtype in tolerances:
        return tolerances[dtype]
    return TOLERANCES.get(dtype, _EXACT if not dtype.is_floating_point else TOLERANCES[torch.float32])


# ---- rows and the report ---------------------------------------------------------------------------
@dataclass(frozen=True)
class TieoutRow:
    """One compared tensor. max_abs = max|a - b|, rel = ||a - b|| / ||b|| (a compiled, b eager);
    tol is the relative bound, max_abs_tol the bound on max_abs (Tolerance.elem * max|b|)."""

    name: str
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    max_abs: float
    rel: float
    tol: float
    max_abs_tol: float
    ok: bool
    note: str = ""


@dataclass
class TieoutReport:
    """Result of `tieout`: `.ok` is True when every row passed (and there is at least one row).

    compiled: the compiled callable that ran (a ThunderModule for mode="jit", the torch.compile'd
    module for mode="dynamo"); backend: the ThunderCompiler for mode="dynamo", else None.
    kforge_symbols: how often each kforge symbol appears in the final forward and backward traces of
    that run; empty means kforge claimed nothing and the tie-out only tested Thunder's fallbacks
    (the summary then says "PASS (torch fallback only: ...)" rather than a bare PASS).
    devices: the device types of the eager run's outputs (e.g. {"cpu"}).
    """

    rows: list[TieoutRow]
    mode: str
    executors: tuple[str, ...]
    kforge_symbols: Counter = field(default_factory=Counter)
    compiled: Any = field(default=None, repr=False)
    backend: Any = field(default=None, repr=False)
    devices: frozenset = field(default_factory=frozenset)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.ok for r in self.rows)

    @property
    def failures(self) -> list[TieoutRow]:
        return [r for r in self.rows if not r.ok]

    def table(self, tablefmt: str = "simple", failures_only: bool = False) -> str:
        """The rows as a `tabulate` table."""
        from tabulate import tabulate

        rows = self.failures if failures_only else self.rows
        body = [
            (
                r.name,
                str(r.dtype).removeprefix("torch.") if r.dtype is not None else "-",
                "x".join(map(str, r.shape)) or "scalar",
                f"{r.max_abs:.3e}",
                f"{r.max_abs_tol:.1e}",
                f"{r.rel:.3e}",
                f"{r.tol:.1e}",
                "ok" if r.ok else "FAIL",
                r.note,
            )
            for r in rows
        ]
        headers = ("tensor", "dtype", "shape", "max_abs", "max_abs_tol", "rel", "rel_tol", "ok", "note")
        return tabulate(body, headers=headers, tablefmt=tablefmt, disable_numparse=True)

    def summary(self) -> str:
        """One line: pass/fail, counts, mode, and how many kforge symbols ran."""
        n_sym = sum(self.kforge_symbols.values())
        verdict = "PASS" if self.ok else f"FAIL ({len(self.failures)} of {len(self.rows)} rows out of tolerance)"
        if self.ok and not n_sym:
            # A bare PASS would read as "kforge's kernels are right" when none of them ran.
            where = " on CPU tensors" if self.devices == {"cpu"} else ""
            verdict = f"PASS (torch fallback only: no kforge kernel ran{where})"
        return (f"tie-out {verdict}: {len(self.rows)} tensors compared, mode={self.mode}, "
                f"{n_sym} kforge symbol(s) in the traces ({len(self.kforge_symbols)} distinct)")

    def __str__(self) -> str:
        return f"{self.table()}\n{self.summary()}"


def compare(
    name: str,
    actual: torch.Tensor | None,
    expected: torch.Tensor | None,
    tolerances: Tolerances | None = None,
) -> TieoutRow:
    """Compare `actual` (compiled) with `expected` (eager) in float64. Non-finite values must sit at
    the same places with the same values; errors are measured over the finite ones. A missing tensor
    on one side, a shape or a dtype difference fails the row."""
    inf = float("inf")

    def fail(note: str, t: torch.Tensor | None) -> TieoutRow:
        return TieoutRow(name, t.dtype if t is not None else None, tuple(t.shape) if t is not None else (),
                         inf, inf, 0.0, 0.0, False, note)

    if actual is None and expected is None:
        return TieoutRow(name, None, (), 0.0, 0.0, 0.0, 0.0, True, "absent in both")
    if actual is None:
        return fail("missing in compiled run", expected)
    if expected is None:
        return fail("missing in eager run", actual)
    if actual.shape != expected.shape:
        return fail(f"shape {tuple(actual.shape)} vs eager {tuple(expected.shape)}", expected)
    if actual.dtype != expected.dtype:
        return fail(f"dtype {actual.dtype} vs eager {expected.dtype}", expected)

    tol = tolerance_for(expected.dtype, tolerances)
    stats = _error_stats(actual.detach().reshape(-1), expected.detach().reshape(-1))
    if stats is None:
        return fail("non-finite values differ", expected)
    num, den, max_abs, ref_max, nonfinite = stats
    rel = num / den if den > 0 else (0.0 if num == 0 else inf)
    max_abs_tol = tol.elem * ref_max
    ok = rel <= tol.rel and max_abs <= max_abs_tol
    note = "non-finite values match" if nonfinite else ""
    return TieoutRow(name, expected.dtype, tuple(expected.shape), max_abs, rel, tol.rel, max_abs_tol, ok, note)


_CHUNK = 1 << 24  # elements per float64 slice: bounds compare's scratch memory for logit-sized tensors


def _error_stats(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float, float, bool] | None:
    """(||a - b||, ||b||, max|a - b|, max|b|, any non-finite) over the finite entries of flat b, in
    float64 slices on b's device; None when a's non-finite entries are not exactly b's."""
    zero = torch.zeros((), dtype=torch.float64, device=b.device)
    num2, den2, max_abs, ref_max, mismatch, nonfinite = zero, zero, zero, zero, zero.bool(), zero.bool()
    for s in range(0, b.numel(), _CHUNK):
        x = a[s:s + _CHUNK].to(b.device, torch.float64)
        y = b[s:s + _CHUNK].to(torch.float64)
        fin_x, fin_y = torch.isfinite(x), torch.isfinite(y)
        same_nonfinite = (x == y) | (torch.isnan(x) & torch.isnan(y))
        mismatch = mismatch | (fin_x != fin_y).any() | (~fin_y & ~same_nonfinite).any()
        nonfinite = nonfinite | (~fin_y).any()
        d = torch.where(fin_y, x - y, 0.0)
        r = torch.where(fin_y, y, 0.0)
        num2, den2 = num2 + d.square().sum(), den2 + r.square().sum()
        max_abs, ref_max = torch.maximum(max_abs, d.abs().max()), torch.maximum(ref_max, r.abs().max())
    if mismatch.item():
        return None
    return num2.sqrt().item(), den2.sqrt().item(), max_abs.item(), ref_max.item(), bool(nonfinite.item())


# ---- compiling, running ----------------------------------------------------------------------------
def default_executors() -> list:
    """`kforge.executors()`: kforge's operators, Thunder's attention executors, kforge's fusion
    executor (unless KFORGE_FUSION=0), then Thunder's other defaults."""
    from .frontend import executors

    return executors()


def compile_model(model: nn.Module, *, mode: Mode = "jit", executors: Sequence | None = None,
                  transforms: Sequence | None = None) -> tuple[Callable, Any]:
    """Compile `model` with Thunder: `thunder.jit(model, executors=..., transforms=...)` for
    mode="jit", or `torch.compile(model, backend=thunder.dynamo.ThunderCompiler(executors=...,
    transforms=...))` for mode="dynamo" (`transforms`: Thunder `Transform`s, e.g. a trace rewrite).
    Returns (compiled callable, ThunderCompiler or None). Parameters stay `model`'s own, so its
    `.grad`s are filled by backward and an optimizer over `model.parameters()` trains the compiled one."""
    import thunder

    options: dict[str, Any] = {"executors": list(default_executors() if executors is None else executors)}
    if transforms:
        options["transforms"] = list(transforms)
    if mode == "jit":
        # as kforge.jit: the lookasides apply to compilations with kforge's executor (module calls,
        # Hugging Face's output collector), installed now that the model's modules are imported
        from .transforms import _install_lookasides

        _install_lookasides()
        return thunder.jit(model, **options), None
    if mode == "dynamo":
        # kforge's compiler: the splitter sees the ambient autocast, and values handed to Inductor
        # arrive in the layout it compiled for
        from .transforms import KforgeThunderCompiler

        backend = KforgeThunderCompiler(**options)
        return torch.compile(model, backend=backend), backend
    raise ValueError(f"tieout mode must be 'jit' or 'dynamo', got {mode!r}")


def thunder_traces(compiled: Any, backend: Any = None) -> list[tuple[Any, Any | None]]:
    """(final forward trace, final backward trace or None) of every Thunder function that ran: the
    jitted function itself, or each Thunder-compiled subgraph of a Dynamo run."""
    import thunder

    fns = [compiled] if backend is None else [
        fn for info in backend.subgraph_infos for fn in (info.thunder_compiled_fns or [])
    ]
    out = []
    for fn in fns:
        try:
            fwd = thunder.last_traces(fn)[-1]
        except TypeError:  # never called (e.g. a subgraph that did not run)
            continue
        try:
            bwd = thunder.last_backward_traces(fn)[-1]
        except (TypeError, IndexError):
            bwd = None
        out.append((fwd, bwd))
    return out


def symbol_counts(trace: Any, prefix: str = "kforge_") -> Counter:
    """How often each symbol whose name starts with `prefix` is called in `trace` (searching inside
    fusion regions and other composite symbols, not inside a matching symbol)."""
    counts: Counter = Counter()

    def walk(bsyms) -> None:
        for b in bsyms:
            if b.sym.name.startswith(prefix):
                counts[b.sym.name] += 1
            else:
                walk(b.subsymbols)

    if trace is not None:
        walk(trace.bound_symbols)
    return counts


@contextlib.contextmanager
def _full_fp32_matmuls() -> Iterator[None]:
    """TF32 off (restored afterwards): fp32 tie-outs need fp32 matmuls on both sides."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


def _two_copies(model: nn.Module | Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    base = model if isinstance(model, nn.Module) else model()
    if not isinstance(base, nn.Module):
        raise TypeError(f"tieout: the model factory returned {type(base).__name__}, not an nn.Module")
    # deepcopy keeps tied parameters tied (its memo maps the shared Parameter once).
    return base, copy.deepcopy(base)


def _split_inputs(inputs: Sequence[Any] | Mapping[str, Any] | torch.Tensor) -> tuple[tuple, dict]:
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    return tuple(inputs), {}


def _fresh_leaves(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[tuple[str, torch.Tensor]]]:
    """Per-run copies of inputs that require grad (so each run gets its own .grad)."""
    leaves: list[tuple[str, torch.Tensor]] = []

    def fresh(name: str, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            y = x.detach().clone().requires_grad_(True)
            leaves.append((name, y))
            return y
        return x

    new_args = tuple(fresh(f"input[{i}]", x) for i, x in enumerate(args))
    new_kwargs = {k: fresh(f"input.{k}", v) for k, v in kwargs.items()}
    return new_args, new_kwargs, leaves


def flatten_outputs(out: Any, prefix: str = "output") -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in a model's output: a tensor, nested tuples / lists, or a
    mapping (Hugging Face ModelOutput included); None and non-tensor leaves are skipped."""
    if isinstance(out, torch.Tensor):
        return [(prefix, out)]
    if isinstance(out, Mapping):
        return [r for k, v in out.items() for r in flatten_outputs(v, f"{prefix}.{k}")]
    if isinstance(out, (tuple, list)):
        return [r for i, v in enumerate(out) for r in flatten_outputs(v, f"{prefix}[{i}]")]
    return []


def _pick_loss(out: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> tuple[str, str | None, torch.Tensor]:
    """(row name, name of the output it came from or None, scalar loss). Without `loss_fn`: an
    output called `loss`, else the first 0-dim floating output with a graph, else a fixed random
    projection of every differentiable floating output (so every output element gets a gradient)."""
    if loss_fn is not None:
        return "loss", None, loss_fn(out)
    flat = flatten_outputs(out)
    diff = [(n, t) for n, t in flat if t.is_floating_point() and t.requires_grad]
    for n, t in diff:
        if n.endswith(".loss") and t.dim() == 0:
            return "loss", n, t
    for n, t in diff:
        if t.dim() == 0:
            return "loss", n, t
    if not diff:
        raise ValueError("tieout: the model returned no differentiable floating tensor; pass loss_fn=")
    g = torch.Generator(device="cpu").manual_seed(1234)
    total = sum((t.float() * torch.randn(t.shape, generator=g).to(t.device)).sum() for _, t in diff)
    return "loss (random projection of outputs)", None, total


def _run(fn: Callable, module: nn.Module, args: tuple, kwargs: dict,
         loss_fn: Callable[[Any], torch.Tensor] | None) -> tuple[list, tuple, list, dict]:
    """One forward + backward: (flat outputs, _pick_loss's triple, input grads, parameter grads)."""
    for p in module.parameters():
        p.grad = None
    args, kwargs, leaves = _fresh_leaves(args, kwargs)
    out = fn(*args, **kwargs)
    loss = _pick_loss(out, loss_fn)
    loss[2].backward()
    grads = {n: p.grad for n, p in module.named_parameters() if p.requires_grad}
    return flatten_outputs(out), loss, [(n, t.grad) for n, t in leaves], grads


def tieout(
    model: nn.Module | Callable[[], nn.Module],
    inputs: Sequence[Any] | Mapping[str, Any] | torch.Tensor,
    *,
    executors: Sequence | None = None,
    mode: Mode = "jit",
    tolerances: Tolerances | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    perturb_compiled: Callable[[nn.Module], None] | None = None,
    transforms: Sequence | None = None,
) -> TieoutReport:
    """Run `model` eagerly and compiled on the same `inputs` and compare outputs, loss and every
    parameter gradient.

    model:      an nn.Module (used as the eager copy; a deep copy is compiled) or a factory returning
                one. It must be deterministic (no active dropout): put it in eval mode or disable it.
    inputs:     positional arguments (a sequence or one tensor) or keyword arguments (a mapping).
                Inputs that require grad are copied per run and their gradients compared too.
    executors:  Thunder executors; default `[kforge.executor, *thunder.get_default_executors()]`.
    mode:       "jit" for `thunder.jit`, "dynamo" for
                `torch.compile(backend=thunder.dynamo.ThunderCompiler(executors=...))`.
    tolerances: one Tolerance for every row, or {dtype: Tolerance} overriding TOLERANCES.
    loss_fn:    maps the model's output to the scalar to backpropagate; by default the output named
                `loss` or the first scalar output (GPT's (logits, loss)), else a fixed random
                projection of the outputs.
    perturb_compiled: called (under no_grad) on the compiled copy before compiling; tests use it to
                show a real difference is caught.
    transforms: Thunder transforms for the compiled copy (see `compile_model`).
    """
    eager_model, compiled_model = _two_copies(model)
    if perturb_compiled is not None:
        with torch.no_grad():
            perturb_compiled(compiled_model)
    compiled, backend = compile_model(compiled_model, mode=mode, executors=executors, transforms=transforms)
    args, kwargs = _split_inputs(inputs)

    with _full_fp32_matmuls():
        out_e, loss_e, leaves_e, grads_e = _run(eager_model, eager_model, args, kwargs, loss_fn)
        out_c, loss_c, leaves_c, grads_c = _run(compiled, compiled_model, args, kwargs, loss_fn)

    rows = []
    loss_from = loss_e[1]
    for (name, te), (_, tc) in zip(out_e, out_c):
        if name != loss_from:  # the loss gets its own row below
            rows.append(compare(name, tc, te, tolerances))
    if len(out_e) != len(out_c):
        rows.append(TieoutRow("outputs", None, (), float("inf"), float("inf"), 0.0, 0.0, False,
                              f"{len(out_c)} compiled outputs vs {len(out_e)} eager"))
    loss_name = loss_e[0] if loss_from is None else f"loss ({loss_from})"
    rows.append(compare(loss_name, loss_c[2], loss_e[2], tolerances))
    for (name, ge), (_, gc) in zip(leaves_e, leaves_c):
        rows.append(compare(f"{name}.grad", gc, ge, tolerances))
    for name, ge in grads_e.items():
        rows.append(compare(f"{name}.grad", grads_c.get(name), ge, tolerances))

    symbols: Counter = Counter()
    for fwd, bwd in thunder_traces(compiled, backend):
        symbols += symbol_counts(fwd) + symbol_counts(bwd)
    used = default_executors() if executors is None else executors
    names = tuple(getattr(e, "name", str(e)) for e in used)
    devices = frozenset(t.device.type for _, t in out_e)
    return TieoutReport(rows, mode, names, symbols, compiled, backend, devices)


# ---- training curves -------------------------------------------------------------------------------
class LossCurves(NamedTuple):
    """Loss per optimizer step, eager and compiled (step i's loss is computed before update i)."""

    eager: list[float]
    compiled: list[float]

    def rel_diffs(self) -> list[float]:
        """|compiled - eager| / |eager| per step."""
        return [abs(c - e) / abs(e) if e != 0 else abs(c - e) for e, c in zip(self.eager, self.compiled)]

    def max_rel_diff(self) -> float:
        return max(self.rel_diffs(), default=0.0)

    def table(self, tablefmt: str = "simple") -> str:
        from tabulate import tabulate

        body = [(i, f"{e:.6f}", f"{c:.6f}", f"{d:.2e}")
                for i, (e, c, d) in enumerate(zip(self.eager, self.compiled, self.rel_diffs()))]
        return tabulate(body, headers=("step", "eager", "compiled", "rel diff"), tablefmt=tablefmt,
                        disable_numparse=True)


def adamw(params: Sequence[nn.Parameter], *, lr: float = 1e-3, weight_decay: float = 0.0,
          betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW as llm.c sets it up: weight decay on matrices and embeddings (dim >= 2) only; fused
    when the parameters are on CUDA."""
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps,
                             fused=True if fused else None)


def loss_curves(
    model: nn.Module | Callable[[], nn.Module],
    inputs: Sequence[Any] | Mapping[str, Any] | torch.Tensor,
    *,
    steps: int = 10,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    executors: Sequence | None = None,
    mode: Mode = "jit",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    transforms: Sequence | None = None,
) -> LossCurves:
    """Train an eager and a compiled copy of `model` (identical weights) for `steps` AdamW steps
    (see `adamw`) on the same `inputs` every step, and return both loss curves. The loss is chosen
    and the model compiled as in `tieout`. The inputs are the same every step, so the curves show
    the model fitting one batch."""
    eager_model, compiled_model = _two_copies(model)
    compiled, _ = compile_model(compiled_model, mode=mode, executors=executors, transforms=transforms)
    args, kwargs = _split_inputs(inputs)
    curves = []
    with _full_fp32_matmuls():
        for fn, module in ((eager_model, eager_model), (compiled, compiled_model)):
            opt = adamw(list(module.parameters()), lr=lr, weight_decay=weight_decay)
            losses = []
            for _ in range(steps):
                loss = _pick_loss(fn(*args, **kwargs), loss_fn)[2]
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach())
            curves.append([float(x) for x in losses])  # one sync per curve, after the loop
    return LossCurves(*curves)


__all__ = [
    "LossCurves",
    "TOLERANCES",
    "TieoutReport",
    "TieoutRow",
    "Tolerance",
    "adamw",
    "compare",
    "compile_model",
    "default_executors",
    "flatten_outputs",
    "loss_curves",
    "symbol_counts",
    "thunder_traces",
    "tieout",
    "tolerance_for",
]
