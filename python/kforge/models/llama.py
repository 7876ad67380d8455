"""Llama reference model for tracing with Thunder + kforge, and a Hugging Face Llama built to match it.

`Llama` is a compact decoder with Hugging Face `LlamaForCausalLM`'s numerics: RMSNorm (mean of
squares in fp32, cast back, times weight), RoPE in the rotate_half layout with HF's cos/sin tables,
grouped-query attention whose k/v heads are expanded by `repeat_kv`, and a SwiGLU MLP. Its Llama
steps are calls of kforge's plain-PyTorch helpers (`rms_norm`, `apply_rope`, `repeat_kv`, `swiglu`,
and `causal_softmax` for manual attention), which `thunder.jit` with the kforge executor swaps for
kforge's operators; run eagerly they are ordinary PyTorch. Two attention variants:
- "manual": causal_softmax(q @ k^T, 1/sqrt(head_dim)) @ v,
- "sdpa":   F.scaled_dot_product_attention(q, k, v, is_causal=True).

Module names follow HF's (`embed_tokens`, `layers.i.self_attn.q_proj`, `mlp.gate_proj`, `norm`,
`lm_head`, ...), so `hf_llama(config)` builds an unmodified `transformers.LlamaForCausalLM` holding
the very same weights: the model kforge must handle through Thunder's Dynamo path
(`kforge.transforms.thunderfx`). Weights are random (seeded); nothing is downloaded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from kforge.models._common import ModelConfig
from kforge.models._common import random_batch  # noqa: F401  (part of this module's API)
from kforge.ops.gqa import repeat_kv
from kforge.ops.rmsnorm import rms_norm
from kforge.ops.rope import apply_rope
from kforge.ops.softmax import causal_softmax
from kforge.ops.swiglu import swiglu

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

AttentionKind = Literal["manual", "sdpa"]

PRESETS: dict[str, dict] = {
    # The benchmark model of the Llama issue: 12 layers, hidden 768, GQA 12 q / 4 kv heads of 64.
    "bench": dict(n_layer=12, n_embd=768, n_head=12, n_kv_head=4, ffn_dim=2048, vocab_size=32000),
    # GPU tie-outs: head_dim 64, GQA ratio 4, a vocabulary that is no multiple of 8, ffn of odd 16s.
    "tiny": dict(block_size=128, n_layer=2, n_embd=512, n_head=8, n_kv_head=2, ffn_dim=1392, vocab_size=1001),
    # Hugging Face route tests: the small LlamaForCausalLM (4 layers, hidden 256, 8 / 2 heads).
    "hf-test": dict(block_size=128, n_layer=4, n_embd=256, n_head=8, n_kv_head=2, ffn_dim=688, vocab_size=1001),
    # CPU tests: seconds to trace and run.
    "micro": dict(block_size=16, n_layer=1, n_embd=32, n_head=4, n_kv_head=2, ffn_dim=48, vocab_size=101),
}


@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    """Llama sizes; the defaults are the benchmark model (PRESETS["bench"]).
    `LlamaConfig.preset(name, **overrides)` gives a named size from PRESETS ("bench", "tiny",
    "hf-test", "micro"); `config.with_(**overrides)` a changed copy."""

    PRESETS = PRESETS
    MODEL_NAME = "Llama"

    block_size: int = 1024  # longest sequence (rows of the RoPE tables)
    vocab_size: int = 32000
    n_layer: int = 12
    n_embd: int = 768  # hidden size
    n_head: int = 12  # query heads
    n_kv_head: int = 4  # key / value heads (GQA: n_head / n_kv_head query heads share each)
    ffn_dim: int = 2048  # SwiGLU hidden size
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    attention: AttentionKind = "manual"

    def __post_init__(self) -> None:
        self._require_positive("block_size", "vocab_size", "n_layer", "n_embd", "n_head", "n_kv_head", "ffn_dim")
        self._require_multiple("n_embd", "n_head")
        self._require_multiple("n_head", "n_kv_head")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even for RoPE")
        if not (self.rope_theta > 0 and self.rms_eps > 0):
            raise ValueError("LlamaConfig: rope_theta and rms_eps must be positive")
        self._require_choice("attention", ("manual", "sdpa"))

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_rep(self) -> int:
        """Query heads per key / value head."""
        return self.n_head // self.n_kv_head


def rope_tables(config: LlamaConfig, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (block_size, head_dim) fp32, as HF's default rotary embedding computes them:
    angle t * theta^(-2i / D) for frequency i, the D / 2 angles repeated twice (rotate_half layout)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float, device=device) / d))
    t = torch.arange(config.block_size, dtype=torch.float, device=device)
    freqs = torch.outer(t, inv_freq)  # the same fp32 products as HF's (D/2, 1) @ (1, T) matmul
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query causal self-attention with RoPE on q and k."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        hd = config.head_dim
        self.q_proj = nn.Linear(config.n_embd, config.n_head * hd, bias=False)
        self.k_proj = nn.Linear(config.n_embd, config.n_kv_head * hd, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_kv_head * hd, bias=False)
        self.o_proj = nn.Linear(config.n_head * hd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.config
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, c.n_head, c.head_dim).transpose(1, 2)  # (B, NH, T, HD)
        k = self.k_proj(x).view(B, T, c.n_kv_head, c.head_dim).transpose(1, 2)  # (B, NKV, T, HD)
        v = self.v_proj(x).view(B, T, c.n_kv_head, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, k, cos, sin)
        if c.n_rep > 1:  # HF's repeat_kv is the identity for n_rep == 1: no copy then
            k, v = repeat_kv(k, c.n_rep), repeat_kv(v, c.n_rep)
        if c.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = causal_softmax(q @ k.transpose(-2, -1), 1.0 / math.sqrt(c.head_dim)) @ v
        return self.o_proj(y.transpose(1, 2).reshape(B, T, c.n_embd))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.ffn_dim, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.ffn_dim, bias=False)
        self.down_proj = nn.Linear(config.ffn_dim, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class Block(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, config.rms_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.rms_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Llama language model: token embedding, `n_layer` decoder layers, final RMSNorm, and an untied
    vocabulary projection.

    `forward(idx, targets=None, return_logits=True) -> (logits, loss)`: idx and targets are (B, T)
    int64 token ids, logits is (B, T, vocab_size); loss is the mean cross-entropy over targets that
    are not -1, or None without targets. `return_logits=False` returns None for the logits (see
    kforge.models.gpt2.GPT: spares Thunder's backward a zero logits gradient).
    """

    def __init__(self, config: LlamaConfig, *, seed: int = 0):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.rms_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        cos, sin = rope_tables(config)
        # Not weights: no state-dict entries, but they follow .to(device, dtype) like HF's cos / sin,
        # which HF computes in fp32 and casts to the activations' dtype.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """N(0, 0.02) embeddings and Linear weights, the two projections per layer that add into
        the residual stream (o_proj, down_proj) scaled by 1/sqrt(2 * n_layer); RMSNorm weights 1.
        Drawn on the CPU in fp32, so the weights are the same on any device and dtype."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, m in self.named_modules():
            if isinstance(m, (nn.Embedding, nn.Linear)):
                std = residual_std if name.endswith(("o_proj", "down_proj")) else 0.02
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * std)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                return_logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if idx.dim() != 2:
            raise ValueError(f"Llama.forward: idx must be (B, T) token ids, got shape {tuple(idx.shape)}")
        B, T = idx.shape
        if B == 0 or T == 0:
            raise ValueError(f"Llama.forward: empty batch, idx has shape {tuple(idx.shape)}")
        if T > self.config.block_size:
            raise ValueError(f"Llama.forward: sequence length {T} exceeds block_size {self.config.block_size}")
        x = self.embed_tokens(idx)
        # (1, T, head_dim) tables in the activations' dtype: what HF's rotary embedding hands
        # apply_rotary_pos_emb for position ids 0..T-1.
        cos = self.rope_cos[None, :T].to(x.dtype)
        sin = self.rope_sin[None, :T].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return (logits if return_logits else None), loss


# ---- Hugging Face --------------------------------------------------------------------------------
def hf_config(config: LlamaConfig, *, attn_implementation: str = "eager"):
    """The `transformers.LlamaConfig` of the same network: no KV cache, untied embeddings, no biases,
    no padding row, default RoPE with `config.rope_theta`."""
    import transformers

    if attn_implementation not in ("eager", "sdpa"):
        raise ValueError(f"hf_config: attn_implementation must be 'eager' or 'sdpa', got {attn_implementation!r}")
    return transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.n_embd,
        intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.n_kv_head,
        head_dim=config.head_dim,
        max_position_embeddings=config.block_size,
        rms_norm_eps=config.rms_eps,
        rope_theta=config.rope_theta,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        pad_token_id=None,
        use_cache=False,
        attn_implementation=attn_implementation,
    )


def hf_llama(
    config: LlamaConfig | str = "hf-test",
    *,
    attn_implementation: str = "eager",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> "LlamaForCausalLM":
    """An unmodified `transformers.LlamaForCausalLM` of `config`'s sizes (a preset name or a
    LlamaConfig) holding exactly `Llama(config, seed=seed)`'s weights; nothing is downloaded.

    Call it as HF models are called, `model(input_ids=idx, labels=idx).loss` (HF shifts the labels
    itself), or compare it with `Llama`: both give the same logits for the same `idx`.
    """
    import transformers

    if isinstance(config, str):
        config = LlamaConfig.preset(config)
    ref = Llama(config, seed=seed)
    model = transformers.LlamaForCausalLM(hf_config(config, attn_implementation=attn_implementation))
    # HF nests everything but lm_head under `model.`; the RoPE buffers are not in either state dict.
    state = {k if k.startswith("lm_head.") else f"model.{k}": v for k, v in ref.state_dict().items()}
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype)
