"""Mixture of experts on CUDA, bf16, Qwen3-30B-A3B layer shapes (hidden 2048, 128 experts, top 8,
expert width 768, 32/4 heads of 128; ``benchmarks/configs/qwen3-30b-a3b-4layers.json``: the real
model's layers, 4 of them, dummy weights).

The engine: every request's token ids and logprobs bitwise equal alone (eager, one sequence) and
in a batch of 64 whose decode steps replay CUDA graphs, with chunked prefill and prefix hits,
under preemption, and ``score(prompt + generation)``; the trainer's logprobs equal the
sampler's. The kernels on one layer: a token's expert output is the same bits alone, in a decode
batch of 64 and in a 2048-token prefill (each taking other tiles), under every tile config, and
it is the bits of the engine's ``linear`` / ``silu_mul`` / ``linear`` on that token. Negative
controls: the standard mode (``F.grouped_mm`` experts, cuBLAS, torch.topk) differs with the
batch, in the engine and in one layer.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from samebits import LLM, SamplingParams  # noqa: E402
from samebits.ops import moe as ops_moe  # noqa: E402
from samebits.ops.backend import get_backend  # noqa: E402
from tests.determinism.workload import run_shuffled  # noqa: E402

CONFIG = str(Path(__file__).parents[2] / "benchmarks" / "configs" / "qwen3-30b-a3b-4layers.json")
MAX_TOKENS = 24
E, H, INTER, TOP_K = 128, 2048, 768, 8


def _llm(**kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 1 << 30)
    kwargs.setdefault("max_model_len", 1024)
    return LLM(CONFIG, load_format="dummy", device="cuda", dtype="bfloat16", seed=0, **kwargs)


@pytest.fixture(scope="module")
def reference():
    rng = random.Random(0)
    shared = [rng.randrange(2, 150000) for _ in range(300)]
    reqs = []
    for i in range(32):
        n = 10 + (290 * i) // 31
        prompt = shared[:n] if i % 4 == 0 else [rng.randrange(2, 150000) for _ in range(n)]
        reqs.append((prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                            ignore_eos=True)))
        reqs.append((prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95,
                                            seed=1000 + i, ignore_eos=True)))
    return reqs, run_shuffled(_llm(max_num_seqs=1, enforce_eager=True), reqs, None)


def _diff(got, want) -> list[int]:
    return [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]


def test_moe_gpu_alone_eager_equals_batch_64_with_cuda_graphs(reference):
    reqs, want = reference
    llm = _llm(max_num_seqs=64)
    assert _diff(run_shuffled(llm, reqs, 1), want) == []
    assert len(llm.engine.runner.graphs.graphs) > 0  # decode steps replayed graphs


def test_moe_gpu_alone_with_graphs_merging_in_o_proj_equals_eager(reference, monkeypatch):
    """Alone with CUDA graphs, each decode token's attention partials are merged inside o_proj's
    staged GEMV (contexts up to 512): the same bits as the eager merge kernel + linear."""
    from samebits.ops.triton import gemv_staged
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the staged GEMVs are Hopper's")
    merged = gemv_staged.merged_partials
    calls = []
    monkeypatch.setattr(gemv_staged, "merged_partials",
                        lambda *a, **k: calls.append(1) or merged(*a, **k))
    reqs, want = reference
    assert _diff(run_shuffled(_llm(max_num_seqs=1), reqs[:16], None), want[:16]) == []
    assert calls  # captured into the decode graphs


def test_moe_gpu_chunked_prefill_prefix_hits_and_score(reference):
    reqs, want = reference
    llm = _llm(max_num_seqs=16, max_num_batched_tokens=37)
    assert _diff(run_shuffled(llm, reqs, 2), want) == []
    outs = llm.generate([r[0] for r in reqs], [r[1] for r in reqs])  # with cache hits
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert _diff([(o.outputs[0].token_ids, o.outputs[0].token_logprobs) for o in outs], want) == []
    scored = llm.score([p + t for (p, _), (t, _) in zip(reqs, want, strict=True)])
    for (prompt, _), (_, logprobs), s in zip(reqs, want, scored, strict=True):
        assert s[len(prompt) - 1:] == logprobs


def test_moe_gpu_bitwise_equal_under_preemption(reference):
    reqs, want = reference
    llm = _llm(max_num_seqs=32, num_kv_blocks=64, enable_prefix_caching=False)
    got = run_shuffled(llm, reqs, 3)
    assert llm.engine.scheduler.num_preemptions > 0
    assert _diff(got, want) == []


def test_moe_gpu_trainer_logprobs_equal_the_samplers(reference):
    from samebits.train import TrainableLM
    reqs, want = reference
    llm = _llm(max_num_seqs=16)
    tl = TrainableLM.from_llm(llm)
    seqs = [p + t for (p, _), (t, _) in zip(reqs[:16], want[:16], strict=True)]
    got = tl.logprobs(seqs, [len(p) for p, _ in reqs[:16]])
    for lp, (_, logprobs) in zip(got, want[:16], strict=True):
        assert lp.detach().cpu().tolist() == logprobs


def test_moe_gpu_standard_mode_differs_with_batch(reference):
    reqs, _ = reference
    alone = run_shuffled(_llm(max_num_seqs=1, batch_invariant=False), reqs[:16], None)
    batched = run_shuffled(_llm(max_num_seqs=64, batch_invariant=False), reqs, 4)[:16]
    assert _diff(batched, alone) != []


# ---- one layer's kernels -----------------------------------------------------------------
@pytest.fixture(scope="module")
def layer():
    g = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    x = rand(2048, H).bfloat16()
    w13, w2 = (rand(E, 2 * INTER, H) / 45).bfloat16(), (rand(E, H, INTER) / 28).bfloat16()
    logits = (x.float() @ (rand(E, H) / 45).T).bfloat16()
    return x, w13, w2, logits


def _experts(ops, x, w13, w2, logits, rows: slice) -> torch.Tensor:
    w, ids = ops_moe.select_experts(ops, logits[rows], TOP_K, True, True)
    return ops_moe.fused_experts(ops, x[rows], w13, w2, w, ids)


def test_expert_rows_are_the_same_alone_in_decode_batches_and_in_prefill(layer):
    from samebits.ops.triton import moe as triton_moe
    x, w13, w2, logits = layer
    ops = get_backend("cuda", True)
    prefill = _experts(ops, x, w13, w2, logits, slice(0, 2048))
    assert triton_moe.pick_config(2048 * TOP_K, E, x.dtype, True).block_m == 64
    for rows in (slice(0, 1), slice(5, 6), slice(0, 64), slice(64, 72), slice(100, 356)):
        assert torch.equal(_experts(ops, x, w13, w2, logits, rows), prefill[rows]), rows


def test_expert_bits_do_not_depend_on_the_tile(layer, monkeypatch):
    from samebits.ops.triton import moe as triton_moe
    x, w13, w2, logits = layer
    w, ids = triton_moe.route(logits[:96], TOP_K, True, True)
    want = triton_moe.fused_experts(x[:96], w13, w2, w, None, None, ids=ids)
    for cfg in [triton_moe.MoeGemmConfig(*c) for c in
                [(16, 32, 128, 4, 4), (16, 64, 256, 4, 3), (16, 64, 256, 4, 3, 2),
                 (32, 64, 128, 4, 4), (64, 64, 64, 4, 3), (64, 128, 64, 8, 3)]]:
        monkeypatch.setattr(triton_moe, "pick_config", lambda *args, c=cfg: c)
        assert torch.equal(triton_moe.fused_experts(x[:96], w13, w2, w, None, None, ids=ids),
                           want), cfg


def test_expert_output_is_the_engines_linear_silu_mul_linear(layer):
    from samebits.ops.triton import moe as triton_moe
    x, w13, w2, logits = layer
    ops = get_backend("cuda", True)
    flat = triton_moe.route(logits[:4], TOP_K, False, False)[1].reshape(-1)
    cfg = triton_moe.pick_config(flat.numel(), E, x.dtype, True)
    sorted_ids = triton_moe.align(flat, E, cfg.block_m)
    act = torch.empty(flat.numel(), INTER, dtype=x.dtype, device="cuda")
    triton_moe.moe_gemm(x, w13, act, sorted_ids, flat, TOP_K, True, cfg)
    y = torch.empty(flat.numel(), H, dtype=x.dtype, device="cuda")
    triton_moe.moe_gemm(act, w2, y, sorted_ids, flat, TOP_K, False,
                        triton_moe.pick_config(flat.numel(), E, x.dtype, False))
    for a in range(flat.numel()):
        t, e = a // TOP_K, int(flat[a])
        gate, up = ops.linear(x[t:t + 1], w13[e]).chunk(2, dim=-1)
        want = ops.silu_mul(gate, up)
        assert torch.equal(act[a:a + 1], want)
        assert torch.equal(y[a:a + 1], ops.linear(want, w2[e]))


def test_route_kernel_picks_the_cpu_definitions_experts(layer):
    from samebits.ops.triton import moe as triton_moe
    logits = layer[3][:512]
    ids = triton_moe.route(logits, TOP_K, True, True)[1]
    want = ops_moe.topk_lowest_id(torch.softmax(logits.float().cpu(), -1), TOP_K)[1]
    assert (ids.cpu() != want).any(1).float().mean() < 0.01  # softmax last-bit ties aside


def test_preloading_down_gemm_in_a_graph_reads_this_layers_experts(layer):
    """Batch 1-4 (one block an assignment) in a CUDA graph with programmatic launch: the down
    GEMM's programs read the ids and their first weight tiles before their wait, while the gate/up
    GEMM runs. Three layers in a row (each routing into memory the graph pool may reuse), then
    the graph replayed on other tokens: every layer's rows equal the eager launches'. The check
    can fail: consecutive layers route to other experts, and one layer's outputs through the
    next layer's experts differ."""
    from samebits.ops.triton import launcher
    from samebits.ops.triton import moe as triton_moe
    x, w13, w2, logits = layer
    cfg = triton_moe.pick_config(3 * TOP_K, E, x.dtype, False)  # the tile moe_gemm takes
    assert cfg.preload and INTER % cfg.block_k == 0 and INTER >= cfg.preload * cfg.block_k
    with launcher.as_captured():
        assert launcher.programmatic(x)
    x_in, l_in = x[:3].clone(), logits[:3].clone()

    def layers() -> list[torch.Tensor]:
        outs, h = [], x_in
        for i in range(3):  # the logits of layer i: rolled, so each layer routes elsewhere
            w, ids = triton_moe.route(l_in.roll(37 * i, 1), TOP_K, True, True)
            h = triton_moe.fused_experts(h, w13, w2, w, None, None, ids=ids)
            outs.append(h)
        return outs

    with launcher.as_captured():
        layers()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), launcher.as_captured():
        captured = layers()
    for rows in (slice(3, 6), slice(40, 43)):
        x_in.copy_(x[rows])
        l_in.copy_(logits[rows])
        g.replay()
        eager = layers()
        for got, want in zip(captured, eager, strict=True):
            assert torch.equal(got, want), rows
    w0, ids0 = triton_moe.route(l_in, TOP_K, True, True)
    w1, ids1 = triton_moe.route(l_in.roll(37, 1), TOP_K, True, True)
    assert not torch.equal(ids0, ids1)
    assert not torch.equal(triton_moe.fused_experts(x_in, w13, w2, w0, None, None, ids=ids1),
                           triton_moe.fused_experts(x_in, w13, w2, w0, None, None, ids=ids0))
