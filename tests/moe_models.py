"""Tiny random mixture-of-experts checkpoints written by transformers itself (the tests' models).

Hidden 64, 8 experts, top-2, a 256-token vocabulary: Qwen3-MoE (q/k norm, renormalized top-k,
a dense layer through ``mlp_only_layers``), Qwen2-MoE (qkv bias, a shared expert with its sigmoid
gate) and Mixtral. Norms and biases get noise and the routers a larger scale than transformers'
init, so every path sees non-trivial values and routing is decided by clear margins.
"""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, num_experts_per_tok=2)
ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")


def tiny_config(arch: str):
    import transformers
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **COMMON, num_hidden_layers=3, head_dim=16, intermediate_size=128,
            moe_intermediate_size=32, num_experts=8, norm_topk_prob=True, mlp_only_layers=[1],
            tie_word_embeddings=False)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **COMMON, num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, num_experts=8, norm_topk_prob=False)
    if arch == "mixtral":
        return transformers.MixtralConfig(**COMMON, num_hidden_layers=2, intermediate_size=32,
                                          num_local_experts=8)
    raise ValueError(arch)


def write_tiny_moe(arch: str, directory: Path, seed: int = 0):
    """Save a tiny random ``arch`` model into ``directory``; returns the transformers model (fp32,
    eval mode, eager attention)."""
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config(arch), attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(".gate.weight"):  # the routers
                p.mul_(20.0)
    model.save_pretrained(directory)
    return model
