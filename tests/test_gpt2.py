"""GPT-2 through Thunder + kforge, tied out against eager PyTorch.

GPU: loss, logits and every parameter gradient of small GPT-2s (manual and SDPA attention, fp32 and
bf16 weights, GPT-2's vocabulary and odd sizes) match eager within `kforge.tieout.TOLERANCES`;
10 AdamW steps track the eager loss curve; every kforge symbol of the manual-attention model is in
the final forward / backward traces; Thunder's Dynamo path; fp64 falls back to torch.
CPU (CI): the reference model itself, CPU tensors falling back to torch through thunder.jit and the
Dynamo path with kforge, the empty-batch error, and the tie-out machinery (including that it fails
when it should).
"""
from __future__ import annotations

import importlib
import math

import pytest
import torch

from conftest import assert_cpu_tieout_falls_back, assert_loss_ignores_targets_and_is_causal, assert_rejects_bad_token_shapes
from conftest import gpu, kforge_executors, tieout_failures
from kforge.models.gpt2 import GPT, GPTConfig, random_batch
from kforge.tieout import (
    TOLERANCES,
    Tolerance,
    compare,
    loss_curves,
    symbol_counts,
    tieout,
)

# Per-step relative difference of the loss allowed between eager and compiled training. fp32: the
# two start within 1e-6 and Adam keeps them together (measured < 2e-7 over 10 steps vs float64).
# bf16: bf16 training itself is within 1.7e-2 of a float64 run of the same weights (measured on the
# tiny config, lr 1e-3 and 3e-4), and one bf16 ulp of a loss near 10 is 6e-3; two bf16 runs may
# each be that far off, hence 3e-2.
CURVE_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}

# Small GPT-2s for the GPU tie-outs: (attention, config overrides, B, T). Head size 64 and GPT-2's
# vocabulary, and an odd one: C = 180 (rows not a multiple of 16 bytes), head size 36 (no 16-byte
# packs in bf16), vocab 4099 (prime), T = 61.
GPU_CASES = {
    "manual-50257": ("manual", dict(), 4, 64),
    "sdpa-50257": ("sdpa", dict(), 4, 64),
    "manual-odd": ("manual", dict(n_embd=180, n_head=5, vocab_size=4099), 3, 61),
}

# kforge.ops modules whose symbols the manual-attention GPT-2 must use, and which of their
# symbols (the softmax module also has plain softmax, which this model does not call).
# The autocast forms (a 16-bit branch added to the fp32 stream, a 16-bit copy of dx) run only when
# the residual stream is wider than the layers' outputs: never in these fp32 / bf16 models.
AUTOCAST_ONLY = {"kforge_add_layernorm_forward", "kforge_layernorm_backward_copy"}
MANUAL_GPT2_OPS = {
    "layernorm": lambda name: name not in AUTOCAST_ONLY,
    "gelu": lambda name: True,
    # The fp32-loss form is for logits upcast first; the unit gradient and its rescale are the
    # opt-in fused path (KFORGE_CE_FUSED=1).
    "cross_entropy": lambda name: "f32" not in name and "unit_grad" not in name and "rescale" not in name,
    "permute": lambda name: "views" not in name,  # split_qkv(copy=False) is the SDPA variant's
    "softmax": lambda name: "causal" in name,
}
# The SDPA variant: no softmax of ours, and q, k, v as views (no forward copy kernel).
SDPA_GPT2_OPS = {**MANUAL_GPT2_OPS, "permute": lambda name: "split_qkv_forward" not in name}
del SDPA_GPT2_OPS["softmax"]


def make_model(config: GPTConfig, dtype: torch.dtype = torch.float32, device: str = "cuda", seed: int = 0) -> GPT:
    """A seeded GPT with LayerNorm weights and all biases randomised (llm.c's init leaves them 1 and
    0, which would let a kernel that ignores weight or bias pass)."""
    model = GPT(config, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.to(device=device, dtype=dtype)


def op_symbols(op: str, keep) -> tuple[set[str], set[str]]:
    """(forward, backward) names of the kforge operators that `kforge.ops.<op>` runs, filtered by
    `keep`. Operators that its SPEC claims (the `replaces=` stand-ins for model helpers such as
    `kforge_causal_softmax`) are left out: they are rewritten into the ones that run."""
    from thunder.core.symbol import Symbol

    mod = importlib.import_module(f"kforge.ops.{op}")
    claimed = {getattr(c.symbol, "name", None) for c in mod.SPEC.claims}
    names = {v.name for v in vars(mod).values()
             if isinstance(v, Symbol) and v.name.startswith("kforge_") and v.name not in claimed
             and keep(v.name)}
    bwd = {n for n in names if "backward" in n}
    return names - bwd, bwd


# ==== the reference model (CPU) =====================================================================
def test_config_presets_and_validation():
    c = GPTConfig()
    assert (c.n_layer, c.n_head, c.n_embd, c.vocab_size, c.block_size) == (12, 12, 768, 50257, 1024)
    assert GPTConfig.preset("tiny").head_size == 64
    assert GPTConfig.preset("micro", attention="sdpa").attention == "sdpa"
    with pytest.raises(ValueError, match="multiple of n_head"):
        GPTConfig(n_embd=100, n_head=3)
    with pytest.raises(ValueError, match="attention"):
        GPTConfig(attention="flash")
    with pytest.raises(ValueError, match="unknown GPT-2 preset"):
        GPTConfig.preset("7B")


def test_model_structure_and_init():
    cfg = GPTConfig.preset("micro", n_layer=3)
    m = GPT(cfg, seed=3)
    assert m.lm_head.weight is m.transformer.wte.weight  # tied
    names = [n for n, _ in m.named_parameters()]
    assert "lm_head.weight" not in names and len(names) == 2 + 12 * cfg.n_layer + 2
    # llm.c's scheme: std 0.02, residual projections 0.02 / sqrt(2 L), zero biases, LayerNorm (1, 0).
    h = m.transformer.h[0]
    assert abs(m.transformer.wte.weight.std().item() - 0.02) < 2e-3
    assert abs(h.mlp.c_fc.weight.std().item() - 0.02) < 2e-3
    assert abs(h.mlp.c_proj.weight.std().item() - 0.02 / math.sqrt(2 * cfg.n_layer)) < 1e-3
    assert h.attn.c_attn.bias.abs().max() == 0 and torch.equal(h.ln_1.weight, torch.ones(cfg.n_embd))
    # Seeded: the same weights for the same seed, different ones for another.
    same, other = GPT(cfg, seed=3), GPT(cfg, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), same.parameters()))
    assert not torch.equal(m.transformer.wte.weight, other.transformer.wte.weight)


def test_forward_shapes_and_initial_loss():
    cfg = GPTConfig.preset("micro")
    idx, targets = random_batch(cfg, 3, 11, seed=1)
    logits, loss = GPT(cfg)(idx, targets)
    assert logits.shape == (3, 11, cfg.vocab_size) and loss.dim() == 0
    # Small random weights give near-uniform predictions: loss close to ln(V).
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1
    assert GPT(cfg)(idx)[1] is None
    # llm.c's training call: the same loss, no logits.
    none, loss2 = GPT(cfg)(idx, targets, return_logits=False)
    assert none is None and torch.equal(loss2, loss)


def test_manual_and_sdpa_attention_agree():
    """The manual path (split_qkv, causal_softmax, merge_heads) computes causal attention exactly as
    SDPA does: same weights, loss and gradients equal in float64."""
    cfg = GPTConfig.preset("micro", n_head=4)
    idx, targets = random_batch(cfg, 2, 13, seed=2, ignore_fraction=0.2)
    manual = make_model(cfg, torch.float64, "cpu")
    sdpa = make_model(cfg.with_(attention="sdpa"), torch.float64, "cpu")
    lm, lossm = manual(idx, targets)
    ls, losss = sdpa(idx, targets)
    lossm.backward()
    losss.backward()
    torch.testing.assert_close(lm, ls, rtol=1e-12, atol=1e-12)
    for (n, pm), (_, ps) in zip(manual.named_parameters(), sdpa.named_parameters()):
        torch.testing.assert_close(pm.grad, ps.grad, rtol=1e-10, atol=1e-12, msg=n)


def test_ignore_index_and_future_tokens():
    """Targets of -1 are left out of the loss, and changing a later token leaves earlier logits alone."""
    cfg = GPTConfig.preset("micro")
    idx, targets = random_batch(cfg, 2, 12, seed=5, ignore_fraction=0.3)
    assert_loss_ignores_targets_and_is_causal(make_model(cfg, torch.float64, "cpu"), idx, targets)


def test_bad_shapes_raise():
    cfg = GPTConfig.preset("micro")
    assert_rejects_bad_token_shapes(GPT(cfg), cfg.block_size)


# ==== bad input through Thunder + kforge (CPU, runs in CI) ===========================================
@pytest.mark.parametrize("attention,dtype", [("manual", torch.float32), ("sdpa", torch.float32),
                                             ("manual", torch.bfloat16)])
def test_cpu_model_falls_back_and_matches_eager(attention, dtype):
    """CPU tensors: every kforge checker declines, thunder.jit runs torch, and eager is matched."""
    cfg = GPTConfig.preset("micro", attention=attention)
    idx, targets = random_batch(cfg, 2, 16, seed=3, ignore_fraction=0.1)
    report = assert_cpu_tieout_falls_back(make_model(cfg, dtype, "cpu"), (idx, targets))
    assert len(report.rows) == 2 + len(list(make_model(cfg, dtype, "cpu").parameters()))


def test_cpu_model_dynamo_path_falls_back():
    torch._dynamo.reset()  # a fresh Dynamo cache: past the recompile limit Dynamo would run eagerly
    cfg = GPTConfig.preset("micro")
    idx, targets = random_batch(cfg, 2, 9, seed=4)
    report = tieout(make_model(cfg, torch.float32, "cpu"), (idx, targets), executors=kforge_executors(), mode="dynamo")
    assert report.ok, tieout_failures(report)
    assert report.backend.subgraph_infos, "Dynamo never handed a graph to Thunder"
    assert not report.kforge_symbols


def test_cpu_loss_curves_track():
    cfg = GPTConfig.preset("micro")
    idx, targets = random_batch(cfg, 2, 16, seed=6)
    curves = loss_curves(make_model(cfg, torch.float32, "cpu"), (idx, targets), steps=10, lr=1e-2,
                         executors=kforge_executors())
    assert curves.max_rel_diff() <= CURVE_TOL[torch.float32], curves.table()
    assert curves.eager[-1] < 0.9 * curves.eager[0], f"did not train:\n{curves.table()}"


def test_empty_batch_is_a_clear_error_cpu():
    """An empty batch is refused with a ValueError, eagerly and under thunder.jit + kforge alike
    (mean cross-entropy over zero tokens would otherwise be a silent NaN)."""
    import thunder

    cfg = GPTConfig.preset("micro")
    idx, targets = random_batch(cfg, 2, 8)
    m = make_model(cfg, torch.float32, "cpu")
    jm = thunder.jit(m, executors=kforge_executors())
    for fn in (m, jm):
        with pytest.raises(ValueError, match="empty batch"):
            fn(idx[:0], targets[:0])
        with pytest.raises(ValueError, match="empty batch"):
            fn(idx[:, :0], targets[:, :0])


# ==== the tie-out machinery itself (CPU) ============================================================
def test_tieout_fails_on_a_perturbed_parameter():
    cfg = GPTConfig.preset("micro")
    idx, targets = random_batch(cfg, 2, 16, seed=7)

    def perturb(m: GPT) -> None:
        m.transformer.h[0].mlp.c_fc.weight[3, 5] += 0.05

    report = tieout(make_model(cfg, torch.float32, "cpu"), (idx, targets), executors=kforge_executors(),
                    perturb_compiled=perturb)
    assert not report.ok
    failing = {r.name for r in report.failures}
    assert "output[0]" in failing and "transformer.h.0.mlp.c_fc.weight.grad" in failing, failing
    assert "FAIL" in report.table() and "FAIL" in report.summary()


def test_tieout_fails_with_an_impossible_tolerance():
    """Thunder's decompositions round differently from eager, so zero tolerance cannot be met."""
    cfg = GPTConfig.preset("micro")
    idx, targets = random_batch(cfg, 2, 16, seed=8)
    report = tieout(make_model(cfg, torch.float32, "cpu"), (idx, targets), executors=kforge_executors(),
                    tolerances=Tolerance(rel=0.0, elem=0.0))
    assert not report.ok and any(r.max_abs > 0 for r in report.rows)


def test_compare_rows():
    g = torch.Generator().manual_seed(0)
    b = torch.randn(500, 70, dtype=torch.float64, generator=g)
    tol = Tolerance(rel=1e-3, elem=1e-3)
    assert compare("same", b.clone(), b, tol).ok
    near = b * (1 + 1e-5)
    r = compare("near", near, b, tol)
    assert r.ok and 0 < r.rel < 2e-5
    one_off = b.clone()
    one_off[3, 4] += 0.01 * b.abs().max()  # one element: the norm hides it, the element bound does not
    r = compare("one element", one_off, b, tol)
    assert r.rel < tol.rel and not r.ok
    nan = b.clone()
    nan[0, 0] = float("nan")
    assert not compare("nan", nan, b, tol).ok
    assert compare("nan both", nan, nan.clone(), tol).ok
    assert not compare("shape", b[:, :6], b, tol).ok
    assert not compare("dtype", b.float(), b, tol).ok
    assert not compare("missing", None, b, tol).ok
    assert compare("absent", None, None, tol).ok
    # Default tolerances follow the eager tensor's dtype.
    x = torch.randn(1000, generator=g)
    assert compare("fp32", x * (1 + 1e-6), x).ok and not compare("fp32", x * (1 + 1e-3), x).ok
    xb = x.bfloat16()
    assert compare("bf16", (x * 1.004).bfloat16(), xb).ok
    assert compare("bf16", (x * 1.004).bfloat16(), xb).tol == TOLERANCES[torch.bfloat16].rel


def test_tieout_input_gradients_and_projection_loss():
    """A model without a scalar output is compared through a fixed random projection, and inputs
    that require grad get gradient rows."""
    lin = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh())
    x = torch.randn(4, 6, requires_grad=True)
    report = tieout(lin, (x,), executors=kforge_executors())
    assert report.ok, tieout_failures(report)
    names = [r.name for r in report.rows]
    assert names[:3] == ["output", "loss (random projection of outputs)", "input[0].grad"], names
    assert x.grad is None  # the caller's tensor is untouched


# ==== GPU: tie-out under thunder.jit + kforge ========================================================
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpt2_tieout_jit(case, dtype):
    attention, overrides, B, T = GPU_CASES[case]
    cfg = GPTConfig.preset("tiny", attention=attention, **overrides)
    idx, targets = random_batch(cfg, B, T, seed=11, device="cuda", ignore_fraction=0.05)
    report = tieout(make_model(cfg, dtype), (idx, targets), executors=kforge_executors())
    assert report.ok, tieout_failures(report)
    n_params = len(list(make_model(cfg, dtype, "cpu").parameters()))
    assert len(report.rows) == 2 + n_params  # logits, loss, every parameter gradient
    # kforge must have run: a tie-out of Thunder's own fallbacks proves nothing about our kernels.
    # SDPA replaces only the causal softmax; the head split and merge are still ours.
    seen = set(report.kforge_symbols)
    for op, keep in (SDPA_GPT2_OPS if attention == "sdpa" else MANUAL_GPT2_OPS).items():
        fwd, bwd = op_symbols(op, keep)
        missing = sorted((fwd | bwd) - seen)
        assert fwd and bwd and not missing, f"{op}: {missing} did not run; ran {sorted(seen)}"
    assert "kforge_residual_forward" in seen, sorted(seen)  # the residual stream's adds


@gpu
def test_gpt2_manual_attention_trace_has_every_kforge_symbol():
    """The demo's check: every forward symbol of the GPT-2 ops in the final forward trace and every
    backward symbol in the final backward trace."""
    import thunder

    cfg = GPTConfig.preset("tiny")
    idx, targets = random_batch(cfg, 2, 64, seed=12, device="cuda")
    jm = thunder.jit(make_model(cfg, torch.bfloat16), executors=kforge_executors())
    _, loss = jm(idx, targets)
    loss.backward()
    fwd_seen = symbol_counts(thunder.last_traces(jm)[-1])
    bwd_seen = symbol_counts(thunder.last_backward_traces(jm)[-1])
    for op, keep in MANUAL_GPT2_OPS.items():
        fwd, bwd = op_symbols(op, keep)
        assert fwd and bwd, f"kforge.ops.{op} has no forward/backward symbols (found {sorted(fwd | bwd)})"
        assert fwd <= set(fwd_seen), f"{op}: {sorted(fwd - set(fwd_seen))} missing from the forward trace"
        assert bwd <= set(bwd_seen), f"{op}: {sorted(bwd - set(bwd_seen))} missing from the backward trace"
    # Per layer: 2 LayerNorms + GELU + split/merge + causal softmax; plus ln_f and the loss.
    assert sum(c for n, c in fwd_seen.items() if "layernorm" in n) == 2 * cfg.n_layer + 1


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_gpt2_adamw_curves_track_eager(attention, dtype):
    cfg = GPTConfig.preset("tiny", attention=attention)
    idx, targets = random_batch(cfg, 4, 64, seed=13, device="cuda")
    curves = loss_curves(make_model(cfg, dtype), (idx, targets), steps=10, lr=1e-3, weight_decay=0.1,
                         executors=kforge_executors())
    assert curves.max_rel_diff() <= CURVE_TOL[dtype], f"\n{curves.table()}"
    assert curves.eager[-1] < 0.9 * curves.eager[0], f"did not train:\n{curves.table()}"


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_gpt2_tieout_dynamo(attention, dtype):
    """Thunder's Dynamo path: Dynamo inlines the attention helpers, so the claims are the torch-level
    ones (layer_norm, gelu, cross_entropy)."""
    torch._dynamo.reset()  # a fresh Dynamo cache: past the recompile limit Dynamo would run eagerly
    cfg = GPTConfig.preset("tiny", attention=attention)
    idx, targets = random_batch(cfg, 4, 64, seed=14, device="cuda")
    report = tieout(make_model(cfg, dtype), (idx, targets), executors=kforge_executors(), mode="dynamo")
    assert report.ok, tieout_failures(report)
    for op in ("layernorm", "gelu", "cross_entropy"):
        fwd, bwd = op_symbols(op, MANUAL_GPT2_OPS[op])
        assert (fwd | bwd) <= set(report.kforge_symbols), (
            f"{op}: {sorted((fwd | bwd) - set(report.kforge_symbols))} not in the Dynamo traces")


# ==== GPU: bad input ================================================================================
@gpu
def test_fp64_model_falls_back():
    cfg = GPTConfig.preset("tiny")
    idx, targets = random_batch(cfg, 2, 32, seed=15, device="cuda")
    report = tieout(make_model(cfg, torch.float64), (idx, targets), executors=kforge_executors())
    assert report.ok, tieout_failures(report)
    assert not report.kforge_symbols, f"kforge ran on fp64: {dict(report.kforge_symbols)}"


@gpu
def test_empty_batch_is_a_clear_error_cuda():
    import thunder

    cfg = GPTConfig.preset("tiny")
    idx, targets = random_batch(cfg, 2, 8, device="cuda")
    jm = thunder.jit(make_model(cfg, torch.bfloat16), executors=kforge_executors())
    with pytest.raises(ValueError, match="empty batch"):
        jm(idx[:0], targets[:0])


@gpu
def test_tieout_fails_on_gpu():
    """With kforge's kernels in the trace, a zero tolerance fails (their rounding differs from
    torch's), and so does one perturbed weight."""
    cfg = GPTConfig.preset("tiny")
    idx, targets = random_batch(cfg, 2, 64, seed=16, device="cuda")
    report = tieout(make_model(cfg, torch.float32), (idx, targets), executors=kforge_executors(),
                    tolerances=Tolerance(rel=0.0, elem=0.0))
    assert not report.ok and report.kforge_symbols

    def perturb(m: GPT) -> None:
        m.transformer.h[1].mlp.c_fc.weight[3, 5] += 0.1

    report = tieout(make_model(cfg, torch.float32), (idx, targets), executors=kforge_executors(),
                    perturb_compiled=perturb)
    assert not report.ok
    assert "transformer.h.1.mlp.c_fc.weight.grad" in {r.name for r in report.failures}, tieout_failures(report)
