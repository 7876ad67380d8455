"""A Llama written in plain PyTorch, the way most training code spells it: `nn.RMSNorm`, rotate-half
RoPE with cos / sin tables of shape (T, head_dim), grouped-query attention expanded with
`repeat_interleave`, `F.scaled_dot_product_attention(is_causal=True)`, and a SwiGLU MLP written as
`F.silu(w1(x)) * w3(x)`. Untied lm_head; the loss on the 16-bit logits.

Plain PyTorch only; nothing here calls kforge.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._build import build, random_tokens

SIZES = {
    "bench": dict(n_layer=12, dim=768, n_heads=12, n_kv_heads=4, hidden_dim=2048, vocab_size=32000, max_seq_len=1024),
    "tiny": dict(n_layer=2, dim=256, n_heads=8, n_kv_heads=2, hidden_dim=688, vocab_size=1001, max_seq_len=256),
    "micro": dict(n_layer=1, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=97, max_seq_len=32),
}


@dataclass
class ModelArgs:
    dim: int = 768
    n_layer: int = 12
    n_heads: int = 12
    n_kv_heads: int = 4
    hidden_dim: int = 2048
    vocab_size: int = 32000
    max_seq_len: int = 1024
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


def rope_cache(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    t = torch.arange(seq_len).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        rep = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layer))
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_cache(args.max_seq_len, args.dim // args.n_heads, args.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        T = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        cos, sin = self.cos[:T].to(h.dtype), self.sin[:T].to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def make(*, size: str = "tiny", batch: int = 4, seq: int | None = None, device: str | torch.device = "cuda",
         dtype: torch.dtype | None = torch.bfloat16, autocast: bool = False, seed: int = 0):
    """(model, (tokens, targets), options): random weights and tokens. `dtype` is the weights' dtype;
    with `autocast`, weights stay fp32 and the step runs under `torch.autocast(dtype)`."""
    torch.manual_seed(seed)
    args = ModelArgs(**SIZES[size])
    seq = min(seq or args.max_seq_len, args.max_seq_len)
    model = build(Transformer, args, device=device, dtype=None if autocast else dtype)
    tokens, targets = random_tokens(args.vocab_size, batch, seq, device, seed + 1)
    return model, (tokens, targets), {"loss_fn": lambda out: out, "autocast": dtype if autocast else None}
