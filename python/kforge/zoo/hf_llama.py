"""Hugging Face's `transformers.LlamaForCausalLM` as people train it: built from a `LlamaConfig` with
random weights (nothing is downloaded), SDPA attention, no KV cache, called as
`model(input_ids=idx, labels=idx).loss` (HF shifts the labels and upcasts the logits to fp32 in its
loss). The sizes are plain_llama's: the "bench" size is issue 18's Llama (12 layers, hidden 768,
12 query / 4 key-value heads, ffn 2048, vocab 32000, 1024 positions).

Thunder's own `thunder.jit` cannot trace this model (transformers' output collector writes a
module-global object when Thunder answers `torch.compiler.is_compiling()` True); `kforge.jit` can
(kforge.lookasides). The bench runs it on Thunder's Dynamo path by default (options mode="dynamo");
`--path jit` takes kforge.jit.
Plain PyTorch / transformers only; nothing here calls kforge.
"""
from __future__ import annotations

import torch

from ._build import hf_dynamo_lm

SIZES = {
    "bench": dict(n_layer=12, dim=768, n_heads=12, n_kv_heads=4, hidden_dim=2048, vocab_size=32000, max_seq_len=1024),
    "tiny": dict(n_layer=2, dim=256, n_heads=8, n_kv_heads=2, hidden_dim=688, vocab_size=1001, max_seq_len=256),
    "micro": dict(n_layer=1, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=97, max_seq_len=32),
}


def config(size: str = "tiny", *, attn_implementation: str = "sdpa", dropout: float = 0.0):
    """The `transformers.LlamaConfig` of a size: untied embeddings, no biases, no padding token,
    default RoPE (theta 10000), RMSNorm eps 1e-5, no KV cache."""
    import transformers

    s = SIZES[size]
    return transformers.LlamaConfig(
        vocab_size=s["vocab_size"],
        hidden_size=s["dim"],
        intermediate_size=s["hidden_dim"],
        num_hidden_layers=s["n_layer"],
        num_attention_heads=s["n_heads"],
        num_key_value_heads=s["n_kv_heads"],
        head_dim=s["dim"] // s["n_heads"],
        max_position_embeddings=s["max_seq_len"],
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=dropout,  # Llama's only dropout: on the attention weights
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
    runs under `torch.autocast(dtype)`; `dropout` is LlamaConfig's attention_dropout. options: mode
    "dynamo", loss_fn `out.loss`."""
    import transformers

    cfg = config(size, attn_implementation=attn_implementation, dropout=dropout)
    return hf_dynamo_lm(transformers.LlamaForCausalLM, cfg, batch=batch, seq=seq, device=device, dtype=dtype,
                        autocast=autocast, seed=seed)
