"""Hugging Face's `transformers.MixtralForCausalLM`, a mixture-of-experts Llama, as people train it:
built from a `MixtralConfig` with random weights (nothing is downloaded), SDPA attention, no KV
cache, called as `model(input_ids=idx, labels=idx).loss`. The "bench" size is issue 18's Llama with
its feed-forward split into 8 experts of 1024, two per token: the same attention, and per token the
same feed-forward work as the Llama's 2048, in 4x the feed-forward weights (12 layers, hidden 768,
12 query / 4 key-value heads, vocab 32000, 1024 positions; 0.29 B parameters).

The experts run through transformers' grouped GEMM (`F.grouped_mm` for bf16 weights, its
`grouped_mm_fallback` custom op for fp32 ones: autocast); the router renormalises its top-2 weights
in place. The bench runs it on Thunder's Dynamo path by default (options mode="dynamo"), as
hf-llama. The router's auxiliary loss is off (router_aux_loss_coef 0, no router logits returned).
Plain PyTorch / transformers only; nothing here calls kforge.
"""
from __future__ import annotations

import torch

from ._build import hf_dynamo_lm
from .plain_llama import SIZES as _LLAMA

# The Llama's sizes with the feed-forward as experts: per token, top_k x expert_dim = the Llama's hidden_dim.
SIZES = {name: {**s, "n_experts": 8 if name == "bench" else 4, "top_k": 2, "expert_dim": s["hidden_dim"] // 2}
         for name, s in _LLAMA.items()}


def config(size: str = "tiny", *, attn_implementation: str = "sdpa", dropout: float = 0.0):
    """The `transformers.MixtralConfig` of a size: untied embeddings, no biases, no padding token,
    RoPE theta 10000 (the Llama's), RMSNorm eps 1e-5, no sliding window, no KV cache."""
    import transformers

    s = SIZES[size]
    return transformers.MixtralConfig(
        vocab_size=s["vocab_size"],
        hidden_size=s["dim"],
        intermediate_size=s["expert_dim"],
        num_hidden_layers=s["n_layer"],
        num_attention_heads=s["n_heads"],
        num_key_value_heads=s["n_kv_heads"],
        head_dim=s["dim"] // s["n_heads"],
        num_local_experts=s["n_experts"],
        num_experts_per_tok=s["top_k"],
        max_position_embeddings=s["max_seq_len"],
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        sliding_window=None,
        hidden_act="silu",
        attention_dropout=dropout,  # Mixtral's only dropout: on the attention weights
        router_jitter_noise=0.0,
        router_aux_loss_coef=0.0,
        output_router_logits=False,
        tie_word_embeddings=False,
        pad_token_id=None,
        use_cache=False,
        attn_implementation=attn_implementation,
    )


def make(*, size: str = "tiny", batch: int = 4, seq: int | None = None, device: str | torch.device = "cuda",
         dtype: torch.dtype | None = torch.bfloat16, autocast: bool = False, seed: int = 0,
         attn_implementation: str = "sdpa", dropout: float = 0.0):
    """(model, {"input_ids", "labels"}, options): random weights (HF's own initialisation, std 0.02)
    and random tokens. `dtype` is the weights' dtype; with `autocast`, weights stay fp32 and the step
    runs under `torch.autocast(dtype)`; `dropout` is MixtralConfig's attention_dropout. options: mode
    "dynamo", loss_fn `out.loss`."""
    import transformers

    cfg = config(size, attn_implementation=attn_implementation, dropout=dropout)
    return hf_dynamo_lm(transformers.MixtralForCausalLM, cfg, batch=batch, seq=seq, device=device, dtype=dtype,
                        autocast=autocast, seed=seed)
