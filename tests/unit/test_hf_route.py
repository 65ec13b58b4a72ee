"""The stock Hugging Face route: under ``samebits.batch_invariant()`` a transformers model of the
engine's weights (``attn_implementation="sdpa"``) gives logits whose log_softmax is bitwise the
engine's sampled logprobs, alone and in a right-padded batch (CPU fp32, the default model), and
backward runs through it. Negative control: the same model outside the block does not match."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

transformers = pytest.importorskip("transformers")

import samebits  # noqa: E402
from samebits import LLM, SamplingParams  # noqa: E402


class Sampled(NamedTuple):
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]


@pytest.fixture(scope="module")
def sampled():
    llm = LLM()
    outs = llm.generate(["The quick brown fox", "Once upon a time, in a land far away,"],
                        SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=7))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        llm.engine.loaded.model_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    return hf, [Sampled(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].token_logprobs)
                for o in outs]


def _picked(logits: torch.Tensor, out) -> torch.Tensor:
    """log_softmax of the logits at the positions that generated ``out``'s tokens."""
    start = len(out.prompt_token_ids)
    rows = torch.log_softmax(logits.float(), -1)[start - 1:start - 1 + len(out.token_ids)]
    return rows.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]


def test_hf_model_alone_gives_the_sampled_logprobs_bitwise(sampled):
    hf, outs = sampled
    with samebits.batch_invariant(), torch.no_grad():
        for out in outs:
            logits = hf(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0]
            assert torch.equal(_picked(logits, out), torch.tensor(out.logprobs))


def test_hf_right_padded_batch_gives_the_sampled_logprobs_and_backward_runs(sampled):
    hf, outs = sampled
    seqs = [o.prompt_token_ids + o.token_ids for o in outs]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    hf.zero_grad()
    with samebits.batch_invariant():
        logits = hf(ids, attention_mask=mask).logits
        picked = [_picked(logits[i], o) for i, o in enumerate(outs)]
        assert all(torch.equal(p.detach(), torch.tensor(o.logprobs))
                   for p, o in zip(picked, outs, strict=True))
        sum(p.sum() for p in picked).backward()
    grad = hf.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_stock_hf_does_not_give_the_sampled_logprobs(sampled):
    """Negative control: without the block (stock kernels, fused sdpa) the bits differ."""
    hf, outs = sampled
    with torch.no_grad():
        out = outs[1]
        logits = hf(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0]
    assert not torch.equal(_picked(logits, out), torch.tensor(out.logprobs))
