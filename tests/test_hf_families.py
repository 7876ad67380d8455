"""Hugging Face causal LMs beyond the zoo, as users bring them: each family at micro size trains one
step under kforge.jit as eager does (fp32, CPU), with kforge.lookasides and kforge.inplace in the
compilation. Thunder's own thunder.jit stops on most of them (transformers' output collector), and
its in-place handling loses or corrupts gradients in some (tests/test_inplace.py)."""
from __future__ import annotations

import pytest
import torch

from conftest import hf_micro_lm, step_matches_eager

# family: (model class, config class, config beyond conftest.hf_micro_lm's defaults)
FAMILIES = {
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(head_dim=16)),     # soft-capped logits, 4 norms a layer
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(head_dim=16)),  # q / k norms, (1 + w) RMSNorm
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", {}),                      # post-norms, q / k norms on the full width
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {}),                         # fused qkv and gate_up projections
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {}),               # rotary on 25 % of the head, parallel residual
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(new_decoder_architecture=True, num_kv_heads=2)),
    "cohere": ("CohereForCausalLM", "CohereConfig", {}),                   # LayerNorm without bias, interleaved RoPE
    "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", {}),       # biases, GELU MLP
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(n_layer=2, n_head=4, attn_implementation="eager")),  # ALiBi
    "gptj": ("GPTJForCausalLM", "GPTJConfig",
             dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=32, attn_implementation="eager")),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_a_step_as_eager_does(family):
    from kforge.transforms import jit

    model, inputs, _ = hf_micro_lm(*FAMILIES[family])
    step_matches_eager(model, inputs, jit)
