"""The trainer side of RL on CUDA, on a Qwen3-0.6B-shaped dummy model in bf16.

- ``TrainableLM.logprobs`` equals the logprobs the engine reported when it sampled the tokens
  (decode steps replaying CUDA graphs), bitwise, at trainer batches of 1, 8 and 32 sequences of
  mixed lengths -- before and after a training step pushed through ``LLM.update_weights``.
- The stock Hugging Face route: a transformers ``Qwen3ForCausalLM`` (``attn_implementation="sdpa"``)
  holding the engine's weights gives, inside ``samebits.batch_invariant()``, logits whose
  log_softmax is bitwise the sampled logprobs (alone and in a right-padded batch; backward runs).

Negative controls: the same HF model outside the block, and the standard mode's trainer against
its own sampler, do not match."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

import samebits  # noqa: E402
from samebits import LLM, SamplingParams  # noqa: E402
from samebits.train import TrainableLM  # noqa: E402
from tests.gpu.findings import record  # noqa: E402

CONFIG = Path(__file__).parents[2] / "benchmarks" / "configs" / "qwen3-0.6b.json"
N = 32
rng = random.Random(3)
PROMPTS = [[rng.randrange(2, 151000) for _ in range(3 + (397 * i) // (N - 1))] for i in range(N)]
rng.shuffle(PROMPTS)  # lengths 3..400, in no order
BATCHES = [[0], [17], [31], [5, 30, 12, 1, 26, 9, 20, 3], list(range(N - 1, -1, -1))]  # 1, 8, 32


def _llm(**kwargs) -> LLM:
    return LLM(str(CONFIG), load_format="dummy", device="cuda", dtype="bfloat16", seed=0,
               max_num_seqs=N, max_model_len=1024, kv_cache_memory_bytes=3 << 30, **kwargs)


def _rollout(llm: LLM, seed: int = 100):
    params = [SamplingParams(max_tokens=4 + i % 13, temperature=1.0, top_p=0.9, seed=seed + i,
                             ignore_eos=True) for i in range(N)]
    outs = llm.generate(PROMPTS, params)
    return ([o.prompt_token_ids + o.outputs[0].token_ids for o in outs], [len(p) for p in PROMPTS],
            [torch.tensor(o.outputs[0].token_logprobs) for o in outs])


def _mismatches(tl: TrainableLM, seqs, starts, sampled) -> dict[int, int]:
    """Trainer batch size -> positions whose trainer logprob differs from the sampled one."""
    bad: dict[int, int] = {}
    for batch in BATCHES:
        got = tl.logprobs([seqs[i] for i in batch], [starts[i] for i in batch])
        n = 0
        for i, lp in zip(batch, got, strict=True):
            assert lp.requires_grad and lp.shape == sampled[i].shape
            n += int((lp.detach().cpu() != sampled[i]).sum())
        bad[len(batch)] = bad.get(len(batch), 0) + n
    return bad


def _train_step(tl: TrainableLM, seqs, starts) -> None:
    tl.zero_grad()
    loss = -sum(lp.sum() for lp in tl.logprobs(seqs, starts))
    loss.backward()
    with torch.no_grad():
        for p in tl.parameters():
            p -= 1e-3 * p.grad.sign()  # a step that bf16 weights (|w| ~ 0.02) cannot round away


def test_gpu_trainer_bf16_logprobs_equal_sampled_at_batches_1_8_32_before_and_after_update():
    llm = _llm()
    assert len(llm.engine.runner.graphs.graphs) > 0
    seqs, starts, sampled = _rollout(llm)
    tl = TrainableLM.from_llm(llm)
    assert _mismatches(tl, seqs, starts, sampled) == {1: 0, 8: 0, 32: 0}
    old_fp = llm.fingerprint
    _train_step(tl, seqs[:8], starts[:8])
    assert llm.update_weights(tl.named_weights()) != old_fp
    seqs2, starts2, sampled2 = _rollout(llm)
    assert any(not torch.equal(a, b) for a, b in zip(sampled, sampled2, strict=True))  # moved
    assert _mismatches(tl, seqs2, starts2, sampled2) == {1: 0, 8: 0, 32: 0}


def test_gpu_negative_control_standard_mode_trainer_differs_from_its_sampler():
    llm = _llm(batch_invariant=False)
    seqs, starts, sampled = _rollout(llm)
    bad = _mismatches(TrainableLM.from_llm(llm), seqs, starts, sampled)
    record("train_standard_trainer_vs_sampler", mismatches=bad)
    assert sum(bad.values()) > 0


def _hf_model(llm: LLM) -> torch.nn.Module:
    """A stock transformers Qwen3 (sdpa) holding the engine's weights, built on the GPU."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(**json.loads(CONFIG.read_text()))
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16,
                                                           attn_implementation="sdpa").eval()
    missing, unexpected = hf.load_state_dict(dict(llm.named_weights()), strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # tied
    return hf


def _picked(logits: torch.Tensor, seq: list[int], start: int) -> torch.Tensor:
    """log_softmax of ``logits`` [S, V] at the positions that produced seq[start:]."""
    rows = torch.log_softmax(logits.float(), -1)[start - 1:len(seq) - 1]
    return rows.gather(1, torch.tensor(seq[start:], device=rows.device)[:, None])[:, 0].cpu()


def test_gpu_hf_route_on_cuda_gives_sampled_logprobs_and_stock_hf_does_not():
    llm = _llm()
    seqs, starts, sampled = _rollout(llm)
    hf = _hf_model(llm)
    alone = [2, 17, 25]
    with torch.no_grad():  # negative control: stock kernels (cuBLAS, fused SDPA, aten RMSNorm)
        stock = [_picked(hf(torch.tensor([seqs[i]], device="cuda")).logits[0], seqs[i], starts[i])
                 for i in alone]
    differing = [i for i, s in zip(alone, stock, strict=True) if not torch.equal(s, sampled[i])]
    record("train_stock_hf_vs_sampled", differing=len(differing), of=len(alone),
           max_abs=max(float((s - sampled[i]).abs().max()) for i, s in zip(alone, stock, strict=True)))
    assert differing != []
    with samebits.batch_invariant():
        with torch.no_grad():
            for i in alone:
                logits = hf(torch.tensor([seqs[i]], device="cuda")).logits[0]
                assert torch.equal(_picked(logits, seqs[i], starts[i]), sampled[i]), i
        batch = BATCHES[3]  # 8 sequences, right-padded, with an attention mask
        width = max(len(seqs[i]) for i in batch)
        ids = torch.tensor([seqs[i] + [0] * (width - len(seqs[i])) for i in batch], device="cuda")
        mask = torch.tensor([[1] * len(seqs[i]) + [0] * (width - len(seqs[i])) for i in batch],
                            device="cuda")
        hf.zero_grad()
        logits = hf(ids, attention_mask=mask).logits
        picked = [_picked(logits[j], seqs[i], starts[i]) for j, i in enumerate(batch)]
        assert [i for i, p in zip(batch, picked, strict=True)
                if not torch.equal(p.detach(), sampled[i])] == []
        rows = torch.log_softmax(logits[0].float(), -1)
        rows[starts[batch[0]] - 1:len(seqs[batch[0]]) - 1].gather(
            1, torch.tensor(seqs[batch[0]][starts[batch[0]]:], device="cuda")[:, None]).sum() \
            .backward()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.input_layernorm.weight",
                 "model.layers.5.self_attn.k_norm.weight"):
        grad = hf.get_parameter(name).grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


def test_gpu_trainer_fast_backward_is_deterministic_and_close_to_the_formulas():
    """The CUDA backward's fast paths (SDPA flash attention VJP in deterministic mode, Triton
    RMSNorm backward): the same step gives the same gradient bits, and the gradients agree with
    the reference formulas' (eager attention, closed-form RMSNorm in torch) to bf16 rounding."""
    from samebits.ops import autograd

    tl = TrainableLM(str(CONFIG), load_format="dummy", device="cuda", dtype="bfloat16", seed=0,
                     max_model_len=1024)
    seqs = [PROMPTS[i] for i in (0, 5, 17, 30)]  # mixed lengths: padded groups
    starts = [1] * len(seqs)

    def grads() -> dict[str, torch.Tensor]:
        tl.zero_grad(set_to_none=True)
        torch.cat(tl.logprobs(seqs, starts)).sum().backward()
        return {n: g.float().clone() for n, g in tl.named_grads()}

    fast = [grads(), grads()]
    assert all(torch.equal(fast[0][n], fast[1][n]) for n in fast[0])
    flags = autograd.SDPA_BACKWARD, autograd.TRITON_RMS_NORM_BACKWARD
    autograd.SDPA_BACKWARD = autograd.TRITON_RMS_NORM_BACKWARD = False
    try:
        ref = grads()
    finally:
        autograd.SDPA_BACKWARD, autograd.TRITON_RMS_NORM_BACKWARD = flags
    worst = max(float((fast[0][n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)) for n in ref)
    record("trainer_fast_backward_vs_formulas", max_rel_err=worst)
    assert worst < 3e-2, worst  # measured 0.018 on the H100 (bf16 gradients, flash vs eager)
