"""The decoder against Hugging Face transformers on the same weights (fp32, CPU).

The default model (the converted SmolLM2 GGUF) and small random-weight Qwen3, Qwen2 and Llama-3
(rope scaling) models saved by transformers itself, so q/k-norm, qkv-bias and GQA paths are covered.
Both numerics modes are checked: invariance must not cost correctness.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from samebits import LLM, SamplingParams  # noqa: E402
from samebits.loader import resolve_model_dir  # noqa: E402

LOGIT_TOL = 1e-3
PROMPTS = [
    "The capital of France is",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n",
    " ".join(f"Item {i}: the {w} of the day." for i, w in
             enumerate(["weather", "news", "music", "food", "sport", "art"] * 6)),  # > 200 tokens
]


def _check(llm: LLM, hf_model, prompts: list[list[int]]) -> None:
    for ids in prompts:
        with torch.no_grad():
            want = hf_model(torch.tensor([ids])).logits[0].float()
        got = llm.engine.prompt_logits(ids)
        assert (got - want).abs().max().item() < LOGIT_TOL
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    for ids, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf_model, ids, 32)


def _hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    """HF greedy decoding with its KV cache, through EOS like ``ignore_eos`` (``generate`` would
    stop at EOS, and its ``min_new_tokens`` masks EOS instead)."""
    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = hf_model(x, past_key_values=past, use_cache=True)
            past, token = res.past_key_values, int(res.logits[0, -1].argmax())
            out.append(token)
            x = torch.tensor([[token]])
    return out


@pytest.fixture(scope="module")
def default_hf_model():
    return transformers.AutoModelForCausalLM.from_pretrained(
        resolve_model_dir(None), dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("invariant", [True, False])
def test_default_model_logits_and_greedy_match_transformers(default_hf_model, invariant):
    llm = LLM(batch_invariant=invariant, max_num_batched_tokens=64)  # chunked prefill too
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert len(prompts[-1]) > 200
    _check(llm, default_hf_model, prompts)


def _small_config(arch: str):
    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=1024)
    if arch == "qwen3":
        return transformers.Qwen3Config(num_key_value_heads=2, head_dim=32,
                                        tie_word_embeddings=False, **common)
    if arch == "qwen2":
        return transformers.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common)
    return transformers.LlamaConfig(num_key_value_heads=1, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}, **common)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama3"])
@pytest.mark.parametrize("invariant", [True, False])
def test_small_random_model_matches_transformers(tmp_path, arch, invariant):
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(
        _small_config(arch), attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)  # non-trivial norms and biases
    hf_model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), batch_invariant=invariant, max_num_batched_tokens=100)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 77, 300)]
    _check(llm, hf_model, prompts)
