"""The engine's determinism suite on CUDA: a dummy Qwen3-shaped model in bf16 through the Triton
kernels. Same criteria as tests/determinism (CPU): every request's token ids and logprobs bitwise
equal alone and in batches of 4/16/64, with chunked prefill, prefix-cache hits and preemption;
score(prompt + generation) == generation logprobs; standard mode (cuBLAS + SDPA) differs.

The reference runs eagerly (``enforce_eager``); the batched runs replay CUDA graphs for their decode
steps (the default), so every comparison also proves graph replay == eager, bit for bit."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from samebits import LLM, SamplingParams  # noqa: E402
from samebits.engine.runner import ModelRunner  # noqa: E402
from tests.determinism.workload import run_shuffled  # noqa: E402

CONFIG = str(Path(__file__).parents[2] / "benchmarks" / "configs" / "qwen3-tiny.json")
MAX_TOKENS = 32


def _llm(**kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 1 << 29)  # leave the GPU to parallel test workers
    return LLM(CONFIG, load_format="dummy", device="cuda", dtype="bfloat16", seed=0, **kwargs)


@pytest.fixture(scope="module")
def reference():
    rng = random.Random(0)
    shared = [rng.randrange(2, 8192) for _ in range(200)]
    reqs = []
    for i in range(32):
        n = 10 + (290 * i) // 31
        prompt = shared[:n] if i % 4 == 0 else [rng.randrange(2, 8192) for _ in range(n)]
        reqs.append((prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                            ignore_eos=True)))
        reqs.append((prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95,
                                            seed=1000 + i, ignore_eos=True)))
    return reqs, run_shuffled(_llm(max_num_seqs=1, enforce_eager=True), reqs, None)


def _diff(got, want) -> list[int]:
    return [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]


@pytest.mark.parametrize("max_num_seqs", [4, 16, 64])
def test_gpu_bitwise_equal_alone_eager_vs_batch_cuda_graphs(reference, max_num_seqs):
    reqs, want = reference
    llm = _llm(max_num_seqs=max_num_seqs)
    assert _diff(run_shuffled(llm, reqs, max_num_seqs), want) == []
    assert len(llm.engine.runner.graphs.graphs) > 0  # decode steps did replay graphs


def test_gpu_graph_alone_equals_eager_alone(reference):
    reqs, want = reference
    assert _diff(run_shuffled(_llm(max_num_seqs=1), reqs[:16], None), want[:16]) == []


def test_gpu_bitwise_equal_chunked_prefill_and_prefix_hits(reference):
    reqs, want = reference
    llm = _llm(max_num_seqs=16, max_num_batched_tokens=37)
    assert _diff(run_shuffled(llm, reqs, 11), want) == []
    outs = llm.generate([r[0] for r in reqs], [r[1] for r in reqs])  # now with cache hits
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert _diff([(o.outputs[0].token_ids, o.outputs[0].token_logprobs) for o in outs], want) == []


def test_gpu_bitwise_equal_under_preemption(reference):
    reqs, want = reference
    llm = _llm(max_num_seqs=32, num_kv_blocks=64, enable_prefix_caching=False)
    got = run_shuffled(llm, reqs, 12)
    assert llm.engine.scheduler.num_preemptions > 0
    assert _diff(got, want) == []


def test_gpu_score_equals_generation_logprobs(reference):
    reqs, want = reference
    scored = _llm(max_num_batched_tokens=61).score(
        [p + t for (p, _), (t, _) in zip(reqs, want, strict=True)])
    for (p, _), (_, lp), s in zip(reqs, want, scored, strict=True):
        assert s[len(p) - 1:] == lp


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_gpu_async_scheduling_changes_no_bit(reference, async_scheduling):
    """Steps launched ahead (input ids read on the device) serve most decode steps and give the
    eager reference's bits; lengths differ, so sequences finish while their successor step is
    already in flight. The control run without it serves none."""
    reqs, want = reference
    lengths = [4 + (7 * i) % (MAX_TOKENS - 3) for i in range(len(reqs))]
    varied = [(p, dataclasses.replace(sp, max_tokens=n))
              for (p, sp), n in zip(reqs, lengths, strict=True)]
    llm = _llm(max_num_seqs=16, async_scheduling=async_scheduling)
    got = run_shuffled(llm, varied, 4)
    assert _diff(got, [(t[:n], lp[:n]) for (t, lp), n in zip(want, lengths, strict=True)]) == []
    used = llm.engine.runner.ahead_steps_used
    assert used > 0 if async_scheduling else used == 0


def test_gpu_async_negative_control_wrong_ahead_ids_differ(reference, monkeypatch):
    """Control for the test above: steps launched ahead that read wrong input ids (each sampled
    token shifted by one) and are served change the bits -- the comparison sees what a served
    step computed."""
    real = ModelRunner._launch_ahead

    def shifted(self, seqs, decode, tokens):
        real(self, seqs, decode, torch.where(tokens > 0, tokens - 1, tokens + 1))

    monkeypatch.setattr(ModelRunner, "_launch_ahead", shifted)
    reqs, want = reference
    llm = _llm(max_num_seqs=16, async_scheduling=True)
    got = run_shuffled(llm, reqs, 4)
    assert llm.engine.runner.ahead_steps_used > 0
    assert _diff(got, want) != []


def test_gpu_negative_control_standard_mode_differs(reference):
    reqs, _ = reference
    alone = run_shuffled(_llm(max_num_seqs=1, batch_invariant=False, enforce_eager=True), reqs,
                         None)
    batched = run_shuffled(_llm(max_num_seqs=64, batch_invariant=False), reqs, 3)
    assert _diff(batched, alone) != []


def test_gpu_standard_mode_computes_the_same_model(reference):
    """The standard backend (cuBLAS, SDPA prefill, batch-chosen decode splits) agrees with the
    invariant engine to bf16 rounding: its greedy tokens' logprobs, rescored by the invariant
    engine, and its own score of the invariant generations."""
    reqs, want = reference
    greedy = [r for i, r in enumerate(reqs) if i % 2 == 0][:8]
    got = run_shuffled(_llm(max_num_seqs=64, batch_invariant=False), greedy, 5)
    rescored = _llm().score([p + t for (p, _), (t, _) in zip(greedy, got, strict=True)])
    for (p, _), (_, lp), s in zip(greedy, got, rescored, strict=True):
        assert max(abs(a - b) for a, b in zip(s[len(p) - 1:], lp, strict=True)) < 0.1


def test_gpu_decode_graphs_are_all_captured_at_start():
    llm = _llm(max_num_seqs=8)
    captured = set(llm.engine.runner.graphs.graphs)
    assert {size for size, _ in captured} == {1, 2, 4, 8}
    assert max(n for _, n in captured) >= 1024
    # a request crossing several length buckets, and a batch shrinking through batch buckets
    prompts = [[3 + i] * (100 + 300 * i) for i in range(4)]
    llm.generate(prompts, SamplingParams(max_tokens=48, ignore_eos=True))
    assert set(llm.engine.runner.graphs.graphs) == captured  # no capture after start


def test_gpu_prompt_logprobs_through_graph_decode_steps_equal_score(reference):
    """Requests keeping prompt logprobs go on to decode through the CUDA graphs (and the steps
    launched ahead): the run completes, and the prompt logprobs are score's, bitwise."""
    reqs, _ = reference
    prompts = [p for p, _ in reqs[:6]]
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=5, prompt_logprobs=1,
                            ignore_eos=True)
    llm = _llm(max_num_seqs=8)
    outs = llm.generate(prompts, params, use_tqdm=False)
    scored = llm.score(prompts)
    for p, out, s in zip(prompts, outs, scored, strict=True):
        assert len(out.outputs[0].token_ids) == 16 and out.prompt_logprobs[0] is None
        assert [out.prompt_logprobs[i + 1][p[i + 1]].logprob for i in range(len(p) - 1)] == s
