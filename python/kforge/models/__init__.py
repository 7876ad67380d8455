"""Reference models for kforge: plain PyTorch, random init, nothing downloaded.

`kforge.models.gpt2`: GPT-2 in the shape of llm.c's `train_gpt2.py` (manual and SDPA attention).
"""
from .gpt2 import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
