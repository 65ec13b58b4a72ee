"""RL on the mixture-of-experts decoders (tiny random Qwen2-MoE with its shared expert, and
Qwen3-MoE, written by transformers; CPU, fp32):

- ``TrainableLM.logprobs`` equals the sampler's logprobs bitwise in trainer batches of 1, 8 and
  32 sequences, before and after ``LLM.update_weights``; gradients reach the routers, the
  experts and the shared expert, are deterministic and agree with transformers'; saved weights
  reload (samebits and transformers) with the per-expert names.
- The HF route: transformers' own Qwen3-MoE under ``samebits.batch_invariant()`` gives the
  engine's sampled logprobs bitwise, alone and in a right-padded batch, and backward runs.
Negative controls: the standard mode's trainer, and stock transformers, do not match.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import samebits  # noqa: E402
from samebits import LLM, SamplingParams  # noqa: E402
from samebits.train import TrainableLM  # noqa: E402
from tests.moe_models import write_tiny_moe  # noqa: E402

KV = dict(num_kv_blocks=128)  # a small cache, quick to allocate
PROMPTS = [[1 + (7 * i + j) % 250 for j in range(3 + (5 * i) % 37)] for i in range(32)]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_moe")
    write_tiny_moe("qwen2_moe", path)
    return path


def _rollout(llm: LLM):
    params = [SamplingParams(max_tokens=3 + i % 4, temperature=1.0, top_p=0.9, seed=100 + i,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    return [o.prompt_token_ids + o.outputs[0].token_ids for o in outs], \
        [len(p) for p in PROMPTS], [torch.tensor(o.outputs[0].token_logprobs) for o in outs]


def _mismatches(tl: TrainableLM, seqs, starts, sampled, batch_sizes=(1, 8, 32)) -> int:
    """Positions where the trainer's logprobs differ from the sampled ones, over trainer
    batches of each size (the 8s in a shuffled order)."""
    bad, order = 0, [(5 * i) % 32 for i in range(32)]
    for size in batch_sizes:
        for lo in range(0, 32, size):
            batch = order[lo:lo + size]
            got = tl.logprobs([seqs[i] for i in batch], [starts[i] for i in batch])
            for i, lp in zip(batch, got, strict=True):
                assert lp.requires_grad and lp.shape == sampled[i].shape
                bad += int((lp.detach() != sampled[i]).sum())
    return bad


def _loss(tl: TrainableLM, seqs, starts) -> torch.Tensor:
    return -sum(lp.sum() for lp in tl.logprobs(seqs, starts))


def test_moe_trainer_logprobs_equal_sampled_before_and_after_update(qwen2_dir, tmp_path):
    llm = LLM(str(qwen2_dir), **KV)
    seqs, starts, sampled = _rollout(llm)
    tl = TrainableLM.from_llm(llm)
    assert _mismatches(tl, seqs, starts, sampled) == 0
    tl.zero_grad()
    _loss(tl, seqs[:8], starts[:8]).backward()
    with torch.no_grad():
        for p in tl.parameters():
            p -= 2.0 * p.grad
    llm.update_weights(tl.named_weights())
    seqs2, starts2, sampled2 = _rollout(llm)
    assert any(not torch.equal(a, b) for a, b in zip(sampled, sampled2, strict=True))
    assert _mismatches(tl, seqs2, starts2, sampled2) == 0
    saved = tl.save_pretrained(tmp_path / "saved")
    seqs3, _, sampled3 = _rollout(LLM(str(saved), **KV))
    assert seqs3 == seqs2 and all(torch.equal(a, b) for a, b in zip(sampled2, sampled3,
                                                                   strict=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    hf_params = dict(hf.named_parameters())
    w = dict(tl.named_weights())
    assert torch.equal(hf_params["model.layers.1.mlp.experts.gate_up_proj"][3, :32],
                       w["model.layers.1.mlp.experts.3.gate_proj.weight"])


def test_moe_gradients_reach_every_part_are_deterministic_and_match_transformers(qwen2_dir):
    llm = LLM(str(qwen2_dir), **KV)
    seqs, starts, _ = _rollout(llm)
    tl = TrainableLM.from_llm(llm)
    grads = []
    for _ in range(2):
        tl.zero_grad()
        _loss(tl, seqs[:6], starts[:6]).backward()
        grads.append({n: g.clone() for n, g in tl.named_grads()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    for part in ("mlp.gate.weight", "mlp.shared_expert_gate.weight", "shared_expert.up_proj",
                 "experts.0.down_proj", "self_attn.q_proj.bias"):
        assert any(part in n and g.abs().sum() > 0 for n, g in grads[0].items()), part
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32,
                                                           attn_implementation="eager")
    loss = 0
    for seq, s in zip(seqs[:6], starts[:6], strict=True):
        logits = hf(torch.tensor([seq])).logits[0].float()
        loss = loss - torch.log_softmax(logits, -1)[s - 1:-1].gather(
            1, torch.tensor(seq[s:])[:, None]).sum()
    loss.backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    for name, g in grads[0].items():
        torch.testing.assert_close(g, _hf_grad(hf_grads, name), rtol=1e-3, atol=1e-5)


def _hf_grad(hf_grads: dict, name: str) -> torch.Tensor:
    """transformers' gradient of HF weight ``name``: per-expert rows of its stacked experts."""
    if ".experts." not in name:
        return hf_grads[name]
    stem, e, proj, _ = name.rsplit(".", 3)  # "model.layers.1.mlp.experts", "3", "up_proj"
    if proj == "down_proj":
        return hf_grads[f"{stem}.down_proj"][int(e)]
    return hf_grads[f"{stem}.gate_up_proj"][int(e)].chunk(2)[proj == "up_proj"]


def test_moe_standard_mode_trainer_differs_from_its_sampler(qwen2_dir):
    """Negative control: with stock kernels the trainer's prefill is not the sampler's decode."""
    llm = LLM(str(qwen2_dir), batch_invariant=False, **KV)
    seqs, starts, sampled = _rollout(llm)
    assert _mismatches(TrainableLM.from_llm(llm), seqs, starts, sampled, batch_sizes=(32,)) > 0


@pytest.fixture(scope="module")
def qwen3_sampled(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    write_tiny_moe("qwen3_moe", path)
    llm = LLM(str(path), **KV)
    prompts = PROMPTS[3:6]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=1.0, seed=7,
                                                ignore_eos=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", dtype=torch.float32).eval()
    return hf, [(p, o.outputs[0].token_ids, torch.tensor(o.outputs[0].token_logprobs))
                for p, o in zip(prompts, outs, strict=True)]


def _picked(logits: torch.Tensor, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    rows = torch.log_softmax(logits.float(), -1)[len(prompt) - 1:len(prompt) - 1 + len(tokens)]
    return rows.gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_hf_qwen3_moe_under_batch_invariant_gives_the_engine_bits(qwen3_sampled):
    hf, outs = qwen3_sampled
    with samebits.batch_invariant(), torch.no_grad():
        for prompt, tokens, logprobs in outs:
            logits = hf(torch.tensor([prompt + tokens])).logits[0]
            assert torch.equal(_picked(logits, prompt, tokens), logprobs)
    seqs = [p + t for p, t, _ in outs]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    hf.zero_grad()
    with samebits.batch_invariant():
        logits = hf(ids, attention_mask=mask).logits
        picked = [_picked(logits[i], p, t) for i, (p, t, _) in enumerate(outs)]
        assert all(torch.equal(x.detach(), lp) for x, (_, _, lp) in zip(picked, outs,
                                                                         strict=True))
        sum(x.sum() for x in picked).backward()
    grad = hf.model.layers[0].mlp.experts.gate_up_proj.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert hf.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_stock_hf_qwen3_moe_does_not_give_the_engine_bits(qwen3_sampled):
    """Negative control: outside the block (stock kernels, fused sdpa, torch's MoE) bits
    differ."""
    hf, outs = qwen3_sampled
    with torch.no_grad():
        bad = sum(int((_picked(hf(torch.tensor([p + t])).logits[0], p, t) != lp).sum())
                  for p, t, lp in outs)
    assert bad > 0
