"""Construct a model directly on its device and in its dtype (no CPU copy, no conversion pass)."""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None):
    if dtype is None:
        yield
        return
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def build(cls, *args, device: str | torch.device, dtype: torch.dtype | None):
    """`cls(*args)` with parameters created on `device` in `dtype` (None: fp32). Buffers computed in
    fp32 explicitly stay fp32."""
    with torch.device(device), _default_dtype(dtype):
        return cls(*args)


def random_tokens(vocab_size: int, batch: int, seq: int, device: str | torch.device, seed: int):
    """(inputs, targets): token ids drawn on the CPU (the same on every device), then moved."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab_size, (batch, seq), generator=g).to(device)
    targets = torch.randint(0, vocab_size, (batch, seq), generator=g).to(device)
    return idx, targets


def hf_causal_lm(cls, cfg, *, positions: int, batch: int, seq: int | None, device: str | torch.device,
                 dtype: torch.dtype | None, autocast: bool, seed: int) -> tuple:
    """(model, {"input_ids", "labels"}, options) of a Hugging Face causal LM `cls(cfg)` as the zoo
    trains it: built on `device` (fp32 weights under `autocast`, else `dtype`), train mode, random
    tokens of length min(seq or positions, positions) as inputs and labels (HF shifts them), the
    loss `out.loss`."""
    seq = min(seq or positions, positions)
    model = build(cls, cfg, device=device, dtype=None if autocast else dtype)
    model.train()
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device)
    return model, {"input_ids": idx, "labels": idx}, {
        "loss_fn": lambda out: out.loss,
        "autocast": dtype if autocast else None,
    }


def hf_dynamo_lm(cls, cfg, *, batch: int, seq: int | None, device: str | torch.device,
                 dtype: torch.dtype | None, autocast: bool, seed: int) -> tuple:
    """`hf_causal_lm` seeded with `seed`, at the config's context length, and options' mode "dynamo"
    (the zoo's Hugging Face Llama-family models run on Thunder's Dynamo path by default)."""
    torch.manual_seed(seed)
    model, inputs, options = hf_causal_lm(cls, cfg, positions=cfg.max_position_embeddings, batch=batch, seq=seq,
                                          device=device, dtype=dtype, autocast=autocast, seed=seed)
    return model, inputs, {**options, "mode": "dynamo"}
