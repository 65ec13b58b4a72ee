"""The trainer side of RL on a small random Llama (GQA, tied head) saved by transformers:
``TrainableLM.logprobs`` equals the sampled logprobs bitwise at any trainer batch, before and after
``LLM.update_weights``; gradients are present, deterministic and agree with transformers'; a bad
update changes nothing; saved weights reload to the same bits. Negative control: the standard
mode's trainer does not match its sampler."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from samebits import LLM, SamplingParams  # noqa: E402
from samebits.train import TrainableLM  # noqa: E402

PROMPTS = [[1 + (7 * i + j) % 250 for j in range(3 + 5 * i)] for i in range(8)]  # 3..38 tokens


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir):
    return tiny_llama_dir


def _rollout(llm: LLM):
    params = [SamplingParams(max_tokens=4 + i % 5, temperature=1.0, top_p=0.9, seed=100 + i,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    return [o.prompt_token_ids + o.outputs[0].token_ids for o in outs], \
        [len(p) for p in PROMPTS], [torch.tensor(o.outputs[0].token_logprobs) for o in outs]


def _mismatches(tl: TrainableLM, seqs, starts, sampled) -> int:
    """Positions where the trainer's logprobs differ from the sampled ones, over trainer batches
    of 1 (each alone), 3 (shuffled) and 8 (reversed)."""
    bad = 0
    batches = [[i] for i in range(8)] + [[5, 0, 3], [7, 2, 6], [1, 4]] + [list(range(7, -1, -1))]
    for batch in batches:
        got = tl.logprobs([seqs[i] for i in batch], [starts[i] for i in batch])
        for i, lp in zip(batch, got, strict=True):
            assert lp.requires_grad and lp.shape == sampled[i].shape
            bad += int((lp.detach() != sampled[i]).sum())
    return bad


def _train_step(tl: TrainableLM, seqs, starts, lr: float = 0.5) -> None:
    tl.zero_grad()
    loss = -sum(lp.sum() for lp in tl.logprobs(seqs, starts))
    loss.backward()
    with torch.no_grad():
        for p in tl.parameters():
            p -= lr * p.grad


def test_trainer_logprobs_equal_sampled_before_and_after_update(model_dir, tmp_path):
    llm = LLM(str(model_dir))
    seqs, starts, sampled = _rollout(llm)
    tl = TrainableLM.from_llm(llm)
    assert _mismatches(tl, seqs, starts, sampled) == 0
    old_fp = llm.fingerprint
    _train_step(tl, seqs, starts)
    new_fp = llm.update_weights(tl.named_weights())
    assert new_fp == llm.fingerprint != old_fp
    seqs2, starts2, sampled2 = _rollout(llm)
    assert any(not torch.equal(a, b) for a, b in zip(sampled, sampled2, strict=True))  # moved
    assert _mismatches(tl, seqs2, starts2, sampled2) == 0
    # a fresh engine on the saved weights gives the same bits
    fresh = LLM(str(tl.save_pretrained(tmp_path / "saved")))
    seqs3, _, sampled3 = _rollout(fresh)
    assert seqs3 == seqs2 and all(torch.equal(a, b) for a, b in zip(sampled2, sampled3, strict=True))


def test_update_never_reuses_prefix_blocks_of_old_weights(model_dir):
    llm = LLM(str(model_dir))
    prompt = list(range(1, 41))  # two full 16-token blocks
    sp = SamplingParams(max_tokens=2, temperature=0.0)
    llm.generate([prompt], sp)
    assert llm.generate([prompt], sp)[0].num_cached_tokens == 32  # the cache works
    w = dict(llm.named_weights())["model.norm.weight"]
    llm.update_weights({"model.norm.weight": w * 1.5})
    assert llm.generate([prompt], sp)[0].num_cached_tokens == 0


@pytest.mark.parametrize("bad, match", [
    ({"model.layers.0.mlp.gate_proj.weights": None}, "gate_proj.weights"),
    ({"model.layers.1.self_attn.k_proj.weight": torch.zeros(32, 63)}, r"k_proj.weight.*shape"),
    ({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64, dtype=torch.float64)},
     r"q_proj.weight.*dtype"),
    ({"model.norm.weight": torch.full((64,), math.nan)}, r"norm.weight.*non-finite"),
])
def test_bad_update_is_rejected_and_changes_nothing(model_dir, bad, match):
    llm = LLM(str(model_dir))
    before = _rollout(llm)[2]
    fp = llm.fingerprint
    good = {"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64)}  # valid, listed first
    name, value = next(iter(bad.items()))
    if value is None:
        value = torch.zeros(128, 64)
    with pytest.raises(ValueError, match=match):
        llm.update_weights({**good, name: value})
    assert llm.fingerprint == fp
    assert all(torch.equal(a, b) for a, b in zip(before, _rollout(llm)[2], strict=True))


def test_gradients_are_present_deterministic_and_match_transformers(model_dir):
    llm = LLM(str(model_dir))
    seqs, starts, _ = _rollout(llm)
    tl = TrainableLM.from_llm(llm)
    grads = []
    for _ in range(2):
        tl.zero_grad()
        (-sum(lp.sum() for lp in tl.logprobs(seqs[:3], starts[:3]))).backward()
        grads.append({n: g.clone() for n, g in tl.named_grads()})
    assert all(g is not None and g.abs().sum() > 0 for g in grads[0].values())
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    loss = 0
    for seq, s in zip(seqs[:3], starts[:3], strict=True):
        logits = hf(torch.tensor([seq])).logits[0].float()
        loss = loss - torch.log_softmax(logits, -1)[s - 1:-1].gather(
            1, torch.tensor(seq[s:])[:, None]).sum()
    loss.backward()
    hf_params = dict(hf.named_parameters())
    for name, g in grads[0].items():
        torch.testing.assert_close(g, hf_params[name].grad, rtol=1e-3, atol=1e-5)


def test_standard_mode_trainer_differs_from_its_sampler(model_dir):
    """Negative control: with stock kernels the trainer's prefill is not the sampler's decode."""
    llm = LLM(str(model_dir), batch_invariant=False)
    seqs, starts, sampled = _rollout(llm)
    assert _mismatches(TrainableLM.from_llm(llm), seqs, starts, sampled) > 0


@pytest.mark.smoke
def test_trainable_lm_loads_like_llm(model_dir):
    llm = LLM(str(model_dir))
    seqs, starts, sampled = _rollout(llm)
    tl = TrainableLM(str(model_dir))
    got = tl.logprobs(seqs[:2], starts[:2])
    assert all(torch.equal(a.detach(), b) for a, b in zip(got, sampled[:2], strict=True))
    names = [n for n, _ in tl.named_weights()]
    assert "model.layers.0.self_attn.q_proj.weight" in names and len(names) == len(set(names))
