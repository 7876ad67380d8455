"""Reference models for kforge: plain PyTorch, random init, nothing downloaded.

`kforge.models.gpt2`: GPT-2 in the shape of llm.c's `train_gpt2.py` (manual and SDPA attention).
`kforge.models.llama`: a compact Llama (RMSNorm, RoPE, GQA, SwiGLU) and `hf_llama`, an unmodified
Hugging Face `LlamaForCausalLM` with the same weights (needs `transformers`).
"""
from .gpt2 import GPT, GPTConfig
from .llama import Llama, LlamaConfig, hf_llama

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "hf_llama"]
