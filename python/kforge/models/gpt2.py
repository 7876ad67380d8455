"""GPT-2 reference model, laid out like llm.c's `train_gpt2.py`, for tracing with Thunder + kforge.

Two attention variants share everything but the attention core:
- "manual": split_qkv -> q @ k^T -> causal_softmax(scale) -> @ v -> merge_heads. The three helpers
  are plain PyTorch functions from kforge.ops; under `thunder.jit` with kforge they are swapped for
  the permute / fused causal-softmax kernels (registered with `replaces=`), so this is the variant
  whose traces hold every GPT-2 kernel.
- "sdpa": F.scaled_dot_product_attention(is_causal=True) between the same head split and merge
  (the split as strided views, which SDPA reads directly: `split_qkv(..., copy=False)`).

Weights are random (seeded, llm.c's scheme); nothing is downloaded. lm_head shares wte's weight.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from kforge.models._common import ModelConfig
from kforge.models._common import random_batch  # noqa: F401  (part of this module's API)
from kforge.ops.permute import merge_heads, split_qkv
from kforge.ops.softmax import causal_softmax

Attention = Literal["manual", "sdpa"]

# Named sizes: the four GPT-2 checkpoints' shapes, and small ones for tests.
PRESETS: dict[str, dict] = {
    "124M": dict(n_layer=12, n_head=12, n_embd=768),
    "350M": dict(n_layer=24, n_head=16, n_embd=1024),
    "774M": dict(n_layer=36, n_head=20, n_embd=1280),
    "1558M": dict(n_layer=48, n_head=25, n_embd=1600),
    # GPU tests: GPT-2's vocabulary and head size 64, two layers.
    "tiny": dict(block_size=64, n_layer=2, n_head=3, n_embd=192),
    # CPU tests: seconds to trace and run.
    "micro": dict(block_size=16, vocab_size=101, n_layer=1, n_head=2, n_embd=32),
}


@dataclass(frozen=True)
class GPTConfig(ModelConfig):
    """GPT-2 sizes; the defaults are GPT-2 124M. `GPTConfig.preset(name, **overrides)` gives a named
    size from PRESETS ("124M", ..., "tiny", "micro"); `config.with_(**overrides)` a changed copy."""

    PRESETS = PRESETS
    MODEL_NAME = "GPT-2"

    block_size: int = 1024  # longest sequence (rows of the position embedding)
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    attention: Attention = "manual"

    def __post_init__(self) -> None:
        self._require_positive("block_size", "vocab_size", "n_layer", "n_head", "n_embd")
        self._require_multiple("n_embd", "n_head")
        self._require_choice("attention", ("manual", "sdpa"))

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.attention = config.attention
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Each (B, NH, T, HS). SDPA reads strided heads itself: no copy for it (kforge then copies
        # only in the backward, to assemble dqkv).
        q, k, v = split_qkv(self.c_attn(x), self.n_head, copy=self.attention != "sdpa")
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = causal_softmax(q @ k.transpose(-2, -1), 1.0 / math.sqrt(q.size(-1)))
            y = att @ v
        return self.c_proj(merge_heads(y))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 language model: token + position embeddings, `n_layer` blocks, final LayerNorm, and a
    vocabulary projection tied to the token embedding.

    `forward(idx, targets=None, return_logits=True) -> (logits, loss)`: idx and targets are (B, T)
    int64 token ids, logits is (B, T, vocab_size); loss is the mean cross-entropy over targets that
    are not -1, or None without targets. `return_logits=False` returns None for the logits (as
    llm.c's training loop asks): under Thunder every returned tensor gets a gradient in the backward,
    and for unused logits that is a zero (B, T, vocab_size) tensor added to the loss gradient.
    """

    def __init__(self, config: GPTConfig, *, seed: int = 0):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # one matrix embeds and un-embeds
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """llm.c's initialisation, reproducible on any device and dtype: N(0, 0.02) for embeddings
        and Linear weights, scaled by 1/sqrt(2 * n_layer) for the two projections per block that
        add into the residual stream (attn.c_proj, mlp.c_proj); zero biases; LayerNorm (1, 0)."""
        g = torch.Generator(device="cpu").manual_seed(seed)

        def normal_(w: torch.Tensor, std: float) -> None:
            # Drawn on the CPU in fp32, then copied: the same weights whatever the model's device/dtype.
            w.copy_(torch.randn(w.shape, generator=g) * std)

        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, m in self.named_modules():
            if isinstance(m, nn.Embedding):
                normal_(m.weight, 0.02)
            elif isinstance(m, nn.Linear):
                if m is not self.lm_head:  # lm_head.weight is wte.weight, already drawn
                    normal_(m.weight, residual_std if name.endswith("c_proj") else 0.02)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.LayerNorm):
                m.weight.fill_(1.0)
                m.bias.zero_()

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, return_logits: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if idx.dim() != 2:
            raise ValueError(f"GPT.forward: idx must be (B, T) token ids, got shape {tuple(idx.shape)}")
        B, T = idx.shape
        if B == 0 or T == 0:
            # Mean cross-entropy over no tokens is 0/0: refuse rather than return NaN.
            raise ValueError(f"GPT.forward: empty batch, idx has shape {tuple(idx.shape)}")
        if T > self.config.block_size:
            raise ValueError(f"GPT.forward: sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C), positions broadcast
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return (logits if return_logits else None), loss
