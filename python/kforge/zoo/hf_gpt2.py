"""Hugging Face's `transformers.GPT2LMHeadModel` as people train it: built from a `GPT2Config` with
random weights (nothing is downloaded), SDPA attention, no KV cache, called as
`model(input_ids=idx, labels=idx).loss`. The sizes are nanogpt's (124M: 12 layers, 12 heads, width
768, vocab 50257, 1024 positions), so the two spellings of one architecture can be compared.

How it differs from nanoGPT's spelling: every projection is transformers' `Conv1D`, a
`torch.addmm(bias, x, w)` with the weight stored (in, out); GELU is the tanh form written out
(`NewGELUActivation`: `0.5 * x * (1 + tanh(...(x + 0.044715 * x**3)))`, which kforge.transforms'
`gelu` pattern finds); the causal mask comes from
transformers' mask utilities; the loss upcasts the logits to fp32 and shifts the labels itself.
Dropout is off by default (GPT2Config's own default is 0.1), as in nanogpt's bench model;
`make(dropout=0.1)` sets GPT2Config's three (embeddings, attention weights, residual branches).

Plain PyTorch / transformers only; nothing here calls kforge.
"""
from __future__ import annotations

import torch

from ._build import hf_causal_lm

SIZES = {
    "124M": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024),
    "tiny": dict(n_layer=2, n_head=4, n_embd=256, vocab_size=1001, n_positions=256),
    "micro": dict(n_layer=1, n_head=2, n_embd=64, vocab_size=97, n_positions=32),
}


def config(size: str = "tiny", *, attn_implementation: str = "sdpa", dropout: float = 0.0):
    """The `transformers.GPT2Config` of a size: tied embeddings, `dropout` (resid, embd and attn
    pdrop; default off), no KV cache."""
    import transformers

    s = SIZES[size]
    return transformers.GPT2Config(
        **s,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
        attn_implementation=attn_implementation,
    )


def make(*, size: str = "tiny", batch: int = 4, seq: int | None = None, device: str | torch.device = "cuda",
         dtype: torch.dtype | None = torch.bfloat16, autocast: bool = False, seed: int = 0,
         attn_implementation: str = "sdpa", dropout: float = 0.0):
    """(model, {"input_ids", "labels"}, options): random weights (HF's own initialisation) and random
    tokens. `dtype` is the weights' dtype; with `autocast`, weights stay fp32 and the step runs under
    `torch.autocast(dtype)`; `dropout` goes to config(). options: loss_fn `out.loss`."""
    import transformers

    torch.manual_seed(seed)
    cfg = config(size, attn_implementation=attn_implementation, dropout=dropout)
    return hf_causal_lm(transformers.GPT2LMHeadModel, cfg, positions=cfg.n_positions, batch=batch, seq=seq,
                        device=device, dtype=dtype, autocast=autocast, seed=seed)
