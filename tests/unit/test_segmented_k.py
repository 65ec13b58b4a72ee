"""Segmented K on the CPU backend (``linear(x, w, k_bounds=...)``, ``linear_partials``,
``silu_mul``) and the decoder's row-parallel layers on one device against their tensor-parallel
path.

What they prove: the segmented product is the ordered fp32 sum of each segment's product computed
alone on its contiguous slice (what a TP rank computes), row by row whatever M; a rank's shard
spans are whole segments (o_proj: its KV groups' columns); the decoder's hidden states and logits
with every row-parallel layer on its gathered-partials path (what N ranks compute) equal the
one-call path bitwise; and, as negative controls, one K chain gives other bits than the segments.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from samebits.models.parallel import RowParallelLinear, ShardSpec
from samebits.ops import cpu_kernels, get_backend
from samebits.ops.backend import AttentionMetadata, bounds, check_k_bounds, ordered_sum, row_parallel_bounds

OPS = get_backend("cpu", batch_invariant=True)
# the TP test model's shape: 12 heads / 6 KV heads of 16, an intermediate size of 200 (uneven)
CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 500, "hidden_size": 96,
          "intermediate_size": 200, "num_hidden_layers": 2, "num_attention_heads": 12,
          "num_key_value_heads": 6, "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "max_position_embeddings": 256, "tie_word_embeddings": False, "eos_token_id": 499}


def _data(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(0, 2, k)  # wide range: sums round
    return x.to(dtype), (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)


def _alone(x: torch.Tensor, w: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Segment [lo, hi)'s product as a rank computes it: the kernel on contiguous copies."""
    cdt = torch.float32 if x.dtype != torch.float64 else torch.float64
    xs, ws = x[:, lo:hi].to(cdt).contiguous(), w[:, lo:hi].contiguous()
    return cpu_kernels.linear(xs, cpu_kernels.packed(ws, cdt), w.shape[0])


@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_rank_spans_are_whole_segments(n):
    """o_proj's columns: rank r owns KV groups [r 6/n, (r+1) 6/n); down_proj's: the same
    segments of the uneven intermediate slices; the ranks' spans tile the dimension."""
    o = [ShardSpec(1, (192,), 6, r, n) for r in range(n)]
    down = [ShardSpec(1, (200,), 6, r, n) for r in range(n)]
    per = 6 // n
    for r in range(n):
        assert o[r].span(0) == (r * per * 32, (r + 1) * per * 32)  # 2 heads of 16 per group
        cuts = bounds(200, 6)[r * per:(r + 1) * per]
        assert down[r].span(0) == (cuts[0][0], cuts[-1][1])
        assert down[r].local_bounds() == tuple((a - cuts[0][0], b - cuts[0][0]) for a, b in cuts)
    assert [s.span(0) for s in down][-1][1] == 200 and sum(down[0].sizes(0)) == 200
    assert bounds(200, 6) == [(0, 34), (34, 68), (68, 101), (101, 134), (134, 167), (167, 200)]
    assert row_parallel_bounds(192, 3) == ((0, 64), (64, 128), (128, 192))


@pytest.mark.parametrize("bad", [(), ((0, 5), (6, 10)), ((0, 5), (5, 9)), ((1, 10),),
                                 ((0, 5), (5, 5), (5, 10))])
def test_check_k_bounds_rejects_what_does_not_tile_k(bad):
    with pytest.raises(ValueError):
        check_k_bounds(bad, 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("k,s", [(200, 6), (192, 3)])
def test_segmented_linear_is_the_ordered_sum_of_segments_alone(dtype, k, s):
    x, w = _data(37, k, 40, dtype)
    b = torch.randn(40).to(dtype)
    kb = row_parallel_bounds(k, s)
    partials = [_alone(x, w, lo, hi) for lo, hi in kb]
    want = ordered_sum(partials).to(dtype) + b
    got = OPS.linear(x, w, b, k_bounds=kb)
    assert torch.equal(got, want)
    assert torch.equal(OPS.linear_partials(x, w, kb), torch.stack(partials))
    for m in (1, 2, 16, 17):  # rows do not depend on M or position
        assert torch.equal(OPS.linear(x[3:3 + m], w, b, k_bounds=kb), got[3:3 + m])
    assert OPS.linear(x.view(37, 1, k), w, k_bounds=kb).shape == (37, 1, 40)
    exact = x.double() @ w.double().T + b.double()
    assert (got.double() - exact).norm() / exact.norm() < (1e-5 if dtype != torch.bfloat16 else 1e-2)


@pytest.mark.smoke
def test_negative_control_one_k_chain_differs_from_segments():
    x, w = _data(37, 200, 40, torch.float32)
    assert not torch.equal(OPS.linear(x, w), OPS.linear(x, w, k_bounds=row_parallel_bounds(200, 6)))


def test_segment_packs_follow_in_place_updates():
    x, w = _data(5, 200, 40, torch.float32)
    kb = row_parallel_bounds(200, 6)
    before = OPS.linear(x, w, k_bounds=kb)
    with torch.no_grad():
        w.mul_(2)  # bumps the version: the kept packs are stale
    assert torch.equal(OPS.linear(x, w, k_bounds=kb), (before * 2))


def test_silu_mul_gives_each_segment_a_ranks_bits():
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(20, 400, generator=g) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    kb = row_parallel_bounds(200, 6)
    got = OPS.silu_mul(gate, up, kb)
    for lo, hi in kb:  # a rank's gate/up product holds only its slice: [T, 2 (hi - lo)]
        local = torch.cat([gate[:, lo:hi], up[:, lo:hi]], dim=-1)
        rank_gate, rank_up = local.chunk(2, dim=-1)
        assert torch.equal(got[:, lo:hi], OPS.silu_mul(rank_gate, rank_up))


def _meta(n: int) -> AttentionMetadata:
    meta = AttentionMetadata(torch.tensor([[0, 1, 2]], dtype=torch.int32),
                             torch.tensor([n], dtype=torch.int32),
                             torch.tensor([0, n], dtype=torch.int32), torch.arange(n), (n,),
                             (0, n), 16, 128)
    return OPS.plan_attention(meta)


def test_decoder_one_call_equals_gathered_partials_path_bitwise(tmp_path):
    """The decoder on one device (o_proj / down_proj: one segmented ``linear`` call each) against
    the same model with every row-parallel layer on its tensor-parallel path (per-segment
    partials on the rank's columns, gathered, added in order, cast, bias)."""
    from samebits import LLM
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    model = LLM(str(path), load_format="dummy", num_kv_blocks=8).engine.runner.model
    rows = [m for m in model.modules() if isinstance(m, RowParallelLinear)]
    assert len(rows) == 4
    for n in (1, 5, 40):
        ids, pos = torch.arange(10, 10 + n), torch.arange(n)
        with torch.inference_mode():
            hidden = model(ids, pos, _caches(), _meta(n))
            for m in rows:
                m.forward = functools.partial(RowParallelLinear.gathered, m)
            try:
                gathered = model(ids, pos, _caches(), _meta(n))
            finally:
                for m in rows:
                    del m.forward
            assert torch.equal(hidden, gathered), n
            assert torch.equal(model.compute_logits(hidden), model.compute_logits(gathered))


def _caches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(4, 16, 6, 16), torch.zeros(4, 16, 6, 16)) for _ in range(2)]
