"""The mixture-of-experts decoders against Hugging Face transformers on the same weights (fp32,
CPU): tiny random Qwen3-MoE, Qwen2-MoE and Mixtral checkpoints written by transformers, loaded
from their per-expert tensors. Prompt logprobs within 1e-4 of transformers' at every position
(chunked prefill included), greedy tokens equal to transformers' greedy decoding with its KV
cache, and each generated token's logprob within 1e-4. Both numerics modes: invariance must not
cost correctness."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from samebits import LLM, SamplingParams  # noqa: E402
from tests.moe_models import ARCHS, write_tiny_moe  # noqa: E402

LOGPROB_TOL = 1e-4
NEW_TOKENS = 16


def _hf_greedy(hf_model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens (KV cache, through EOS) and their logprobs."""
    tokens, logprobs, past, x = [], [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = hf_model(x, past_key_values=past, use_cache=True)
            past = res.past_key_values
            row = torch.log_softmax(res.logits[0, -1].float(), -1)
            tokens.append(int(row.argmax()))
            logprobs.append(float(row[tokens[-1]]))
            x = torch.tensor([[tokens[-1]]])
    return tokens, logprobs


def _check(llm: LLM, hf_model, prompts: list[list[int]]) -> None:
    for ids in prompts:
        with torch.no_grad():
            want = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
        got = torch.log_softmax(llm.engine.prompt_logits(ids), -1)
        assert (got - want).abs().max().item() < LOGPROB_TOL
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                ignore_eos=True))
    for ids, out in zip(prompts, outs, strict=True):
        tokens, logprobs = _hf_greedy(hf_model, ids, NEW_TOKENS)
        assert out.outputs[0].token_ids == tokens
        assert max(abs(a - b) for a, b in zip(out.outputs[0].token_logprobs, logprobs,
                                              strict=True)) < LOGPROB_TOL


@pytest.mark.parametrize("invariant", [True, pytest.param(False, marks=pytest.mark.slow)])
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_moe_matches_transformers(tmp_path, arch, invariant):
    hf_model = write_tiny_moe(arch, tmp_path)
    llm = LLM(str(tmp_path), batch_invariant=invariant, max_num_batched_tokens=64,
              num_kv_blocks=64)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 90)]
    _check(llm, hf_model, prompts)


def test_stacked_expert_checkpoint_loads_like_per_expert(tmp_path):
    """transformers' in-memory stacked layout (``save_original_format=False``) gives the same
    model as its per-expert checkpoint."""
    hf_model = write_tiny_moe("mixtral", tmp_path / "per_expert")
    hf_model.save_pretrained(tmp_path / "stacked", save_original_format=False)
    from safetensors import safe_open
    with safe_open(tmp_path / "stacked" / "model.safetensors", "pt") as f:
        assert any(k.endswith("experts.gate_up_proj") for k in f.keys())  # noqa: SIM118
    a = LLM(str(tmp_path / "per_expert"), num_kv_blocks=8)
    b = LLM(str(tmp_path / "stacked"), num_kv_blocks=8)
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.named_weights(), b.named_weights(),
                                                          strict=True))


def test_a_rank_reads_only_its_experts_of_a_stacked_checkpoint(tmp_path, monkeypatch):
    """Rank 1 of 2 loading the stacked layout reads experts 4-7 alone (each a part of the
    stacked safetensors slice), and holds exactly transformers' weights for them."""
    import json

    from safetensors import safe_open

    from samebits.distributed.group import TPGroup
    from samebits.loader import build_model
    from samebits.models import moe as moe_model
    from samebits.models import registry
    from samebits.ops.backend import get_backend
    hf_model = write_tiny_moe("mixtral", tmp_path / "per_expert")
    hf_model.save_pretrained(tmp_path / "stacked", save_original_format=False)
    config = json.loads((tmp_path / "stacked" / "config.json").read_text())
    model = build_model(registry.model_config(config), get_backend("cpu", True), 64, "cpu",
                        torch.float32, TPGroup(1, 2))
    read: set[int] = set()
    part_read = moe_model._ExpertPart.__getitem__
    monkeypatch.setattr(moe_model._ExpertPart, "__getitem__",
                        lambda self, index: read.add(self.e) or part_read(self, index))
    with safe_open(tmp_path / "stacked" / "model.safetensors", "pt") as f:
        model.load_weights((k, f.get_slice(k)) for k in f.keys())  # noqa: SIM118
    assert read == {4, 5, 6, 7}
    want = hf_model.model.layers[1].mlp.experts
    held = model.layers[1].mlp.experts_gate_up.view(4, -1, 64)
    assert torch.equal(held, want.gate_up_proj[4:].detach())
