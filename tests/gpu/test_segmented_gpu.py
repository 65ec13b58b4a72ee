"""Segmented K on CUDA: o_proj and down_proj with the tensor-parallel arithmetic (one fp32 partial
per K segment, added in ``tree_sum``'s balanced tree order), eager or in CUDA graphs.

What the tests prove, bit for bit: ``linear(x, w, k_bounds=...)`` is the tree-ordered fp32 sum of
each segment's product computed alone on its contiguous slice, for near-equal bounds (even and
uneven, 16-aligned or not), every dtype, power-of-two segment counts (the tree sum kernel) and
others (torch's ``tree_sum``), at every row count; and ``LLM()`` (CUDA graphs) returns the tokens
and logprobs of the same model with its row-parallel layers on their tensor-parallel path (the
rank's partials tree-summed by torch) -- the arithmetic every TP size shares. Negative controls:
one K chain, and the chain of the segment partials, give other bits. Skipped without CUDA.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from samebits import LLM, SamplingParams  # noqa: E402
from samebits.ops.backend import row_parallel_bounds, tree_sum  # noqa: E402
from samebits.ops.triton import linear as L  # noqa: E402

QWEN3_TINY = str(Path(__file__).parents[2] / "benchmarks" / "configs" / "qwen3-tiny.json")
# 3 KV heads: o_proj segments of 128 columns, MLP segments 334 / 333 / 333 (not 16-aligned)
UNEVEN = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 4096, "hidden_size": 384,
          "intermediate_size": 1000, "num_hidden_layers": 3, "num_attention_heads": 6,
          "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 2048,
          "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": False,
          "eos_token_id": 1}


def _data(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) / k ** 0.5
    return x.to(dtype), w.to(dtype)


def _segments_alone(x: torch.Tensor, w: torch.Tensor, kb) -> list[torch.Tensor]:
    return [L.partials(x[:, lo:hi].contiguous(), w[:, lo:hi].contiguous(), ((0, hi - lo),))[0]
            for lo, hi in kb]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k,s", [(4096, 8), (12288, 8), (1000, 3), (200, 6), (1024, 4)])
def test_segmented_linear_is_the_tree_sum_of_segments_alone(dtype, k, s):
    x, w = _data(300, k, 1024, dtype)
    b = torch.randn(1024, device="cuda").to(dtype)
    kb = row_parallel_bounds(k, s)
    alone = _segments_alone(x, w, kb)
    acc = tree_sum(torch.stack(alone))
    for m in (1, 7, 16, 64, 65, 300):  # pick_config's tiles up to 64 rows, SEGMENTED_TILE above
        got = L.linear(x[:m], w, b, k_bounds=kb)
        assert torch.equal(got, acc[:m].to(dtype) + b), m
    assert torch.equal(L.partials(x, w, kb), torch.stack(alone))
    if dtype != torch.float32:  # a segment alone through the plain (TMA / pointer) kernels
        for (lo, hi), p in zip(kb, alone, strict=True):
            plain = L.linear(x[:, lo:hi].contiguous(), w[:, lo:hi].contiguous())
            assert torch.equal(plain, p.to(dtype))


# Qwen3-8B's row-parallel shapes (K, N, segments): TP 1 (all 8 KV-head segments) and a TP 2 rank (4)
QWEN3_8B_ROW_PARALLEL = [(4096, 4096, 8), (12288, 4096, 8), (2048, 4096, 4), (6144, 4096, 4)]


def _split_schedule(x, w, kb, dtype):
    """The pointer kernel's split schedule (partials, then the tree sum kernel) into ``dtype``."""
    out = x.new_empty(x.shape[0], w.shape[0], dtype=dtype)
    L.run(x, w, None, out, L.SEGMENTED_TILE, L.SegmentLayout.from_bounds(kb, x.shape[1]))
    return out


@pytest.mark.parametrize("m", [65, 512, 2048, 8192])
@pytest.mark.parametrize("k,n,s", QWEN3_8B_ROW_PARALLEL)
def test_segmented_tma_kernel_is_the_split_schedule(k, n, s, m):
    """``linear`` / ``linear_sum`` above 64 rows run ``_segmented_tma_kernel``: bit for bit the
    split schedule's output (bf16 cast, fp32 sum), and a row's bits do not depend on M."""
    x, w = _data(m, k, n, torch.bfloat16, seed=m)
    b = torch.randn(n, device="cuda").to(torch.bfloat16)
    kb = row_parallel_bounds(k, s)
    layout = L.SegmentLayout.from_bounds(kb, k)
    cfg = L.segmented_config(m, n, k, x.dtype, layout)
    assert cfg.tma and layout.even(k, cfg.block_k)
    total = _split_schedule(x, w, kb, torch.float32)
    assert torch.equal(L.linear_sum(x, w, kb), total)
    got = L.linear(x, w, b, k_bounds=kb)
    assert torch.equal(got, _split_schedule(x, w, kb, torch.bfloat16) + b)
    assert torch.equal(L.linear(x[m - 65:], w, b, k_bounds=kb), got[m - 65:])


def test_negative_control_one_k_chain_differs_from_segments():
    x, w = _data(64, 4096, 1024, torch.bfloat16, seed=1)
    assert not torch.equal(L.linear(x, w), L.linear(x, w, k_bounds=row_parallel_bounds(4096, 8)))


def test_negative_control_chain_of_partials_differs_from_the_tree():
    x, w = _data(64, 4096, 1024, torch.float32, seed=2)
    kb = row_parallel_bounds(4096, 8)
    parts = L.partials(x, w, kb)
    chain = parts[0].clone()
    for p in parts[1:]:
        chain += p
    assert torch.equal(L.linear(x, w, k_bounds=kb), tree_sum(parts))
    assert not torch.equal(L.linear(x, w, k_bounds=kb), chain)


def _one_rank_reference(config: str, prompts, params):
    """The same model with every row-parallel layer on its tensor-parallel path (``gathered``:
    the rank's ``linear_sum`` over its chains, handed to the next norm as a one-rank sum),
    eager."""
    from samebits.models.parallel import RowParallelLinear
    llm = LLM(config, load_format="dummy", device="cuda", dtype="bfloat16", seed=0,
              kv_cache_memory_bytes=1 << 28, enforce_eager=True)
    for m in llm.engine.runner.model.modules():
        if isinstance(m, RowParallelLinear):
            m.forward = functools.partial(RowParallelLinear.gathered, m)
    return [(o.outputs[0].token_ids, o.outputs[0].token_logprobs) for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def uneven_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("seg") / "config.json"
    path.write_text(json.dumps(UNEVEN))
    return str(path)


@pytest.mark.parametrize("which", ["qwen3-tiny", "uneven"])
def test_default_engine_equals_one_rank_tp_model(which, uneven_config):
    """One GPU runs the K chains of every TP size its chain count allows (qwen3-tiny: 2 KV heads,
    two chains; uneven: 3 KV heads, one chain) on its one-device path."""
    config = QWEN3_TINY if which == "qwen3-tiny" else uneven_config
    prompts = [[3 + i] * (5 + 37 * i) for i in range(6)]
    params = [SamplingParams(max_tokens=24, temperature=0.8 * (i % 2), seed=i, ignore_eos=True)
              for i in range(6)]
    llm = LLM(config, load_format="dummy", device="cuda", dtype="bfloat16", seed=0,
              kv_cache_memory_bytes=1 << 28, max_num_seqs=8)  # decode replays CUDA graphs
    got = [(o.outputs[0].token_ids, o.outputs[0].token_logprobs) for o in llm.generate(prompts, params)]
    assert len(llm.engine.runner.graphs.graphs) > 0
    assert got == _one_rank_reference(config, prompts, params)
