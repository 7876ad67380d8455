"""Models written the way people write them, for benchmarks and tie-outs of users' models.

Nothing here imports kforge's helpers: each model is plain PyTorch, spelled as its namesake spells it
(nanoGPT's GPT-2, a Llama in the style of Meta's reference / llama2.c / litgpt, Hugging Face's
LlamaForCausalLM, GPT2LMHeadModel and MixtralForCausalLM). kforge has to find the mission's steps in these traces by itself.

Every module has `make(*, size, batch, seq, device, dtype, autocast, seed) -> (model, inputs, options)`,
the `--model` factory contract of `python -m kforge`, and a `SIZES` table.
"""
from __future__ import annotations

MODELS = {
    "nanogpt": "kforge.zoo.nanogpt:make",
    "plain-llama": "kforge.zoo.plain_llama:make",
    "hf-llama": "kforge.zoo.hf_llama:make",
    "hf-gpt2": "kforge.zoo.hf_gpt2:make",
    "hf-mixtral": "kforge.zoo.hf_mixtral:make",
}
