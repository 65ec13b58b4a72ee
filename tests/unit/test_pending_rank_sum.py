"""A row-parallel layer's rank sum folded into the residual add + RMSNorm (``PendingRankSum``),
on the Triton kernels under ``TRITON_INTERPRET=1`` (tiny shapes; tests/gpu/test_pending_rank_sum_gpu.py
runs them on CUDA in bf16, eager and graph-replayed).

What they prove, bit for bit: ``rms_norm(PendingRankSum(parts, dtype), w, eps, residual)`` on the
Triton backend (one launch: the tree sum, one cast, the add, the norm) is ``sum_tree(parts,
dtype)`` then ``rms_norm(x, w, eps, residual)``, both outputs, for N = 2, 4, 8 parts, 1 to 5 rows
and a prefill's rows, fp32 / fp16 / bf16; counts the kernel does not take, and a norm without a
residual, are resolved first (the same bits). A decoder under (simulated) tensor parallel, whose
o_proj and down_proj hand their gathered sums to the norms, gives the hidden states of the same
decoder summing them first. Negative controls: adding the parts in chain order, or casting them
before adding, gives other bits -- and a decoder summing in chain order other hidden states.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch

from samebits.config import ModelConfig
from samebits.distributed.group import TPGroup
from samebits.ops.backend import AttentionMetadata
from samebits.ops.pending_rank_sum import PendingRankSum, resolved

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton kernels run compiled here (tests/gpu)")

H, EPS = 48, 1e-6  # a hidden size below its power-of-two block: masked columns
ROWS = [1, 2, 3, 4, 5, 40]  # decode rows, and a prefill's (more than one program of 16 rows)


@functools.cache
def _ops():
    from samebits.ops.triton.backend import TritonBackend
    return TritonBackend()


def _case(n: int, lead: tuple[int, ...], dtype: torch.dtype, seed: int):
    """fp32 parts [n, *lead, H] of unlike magnitudes, a residual and a norm weight."""
    g = torch.Generator().manual_seed(seed)
    parts = torch.randn(n, *lead, H, generator=g) * torch.logspace(0, 2, H)
    parts = parts * torch.logspace(0, 1, n).view(n, *([1] * (len(lead) + 1)))
    residual = (torch.randn(*lead, H, generator=g) * 30).to(dtype)
    w = (1 + torch.randn(H, generator=g) / 4).to(dtype)
    return parts, residual, w


def _unfused(ops, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor):
    return ops.rms_norm(x, w, EPS, residual)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_rank_sum_norm_is_sum_tree_then_add_norm(n: int, dtype: torch.dtype) -> None:
    from samebits.ops.triton import rms_norm as RN
    ops, calls = _ops(), []
    for i, t in enumerate(ROWS):
        parts, residual, w = _case(n, (t,), dtype, seed=10 * n + i)
        pending = PendingRankSum(parts, dtype)
        assert RN.takes_rank_sum(pending)
        want = _unfused(ops, ops.sum_tree(parts, dtype), w, residual)
        got = ops.rms_norm(pending, w, EPS, residual)
        calls.append(RN.rank_sum_add_rms_norm(pending, residual, w, EPS))
        for a, b, c in zip(got, want, calls[-1], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b) and torch.equal(c, b), (t, dtype)


def test_fused_rank_sum_norm_takes_a_batch_lead_and_a_strided_residual() -> None:
    ops = _ops()
    parts, residual, w = _case(4, (2, 3), torch.float16, seed=1)
    wide = torch.cat([residual, residual], dim=-1)[..., H:]  # an offset view
    got = ops.rms_norm(PendingRankSum(parts, torch.float16), w, EPS, wide)
    want = _unfused(ops, ops.sum_tree(parts, torch.float16), w, wide)
    assert got[0].shape == (2, 3, H)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("n", [1, 3, 16])
def test_other_counts_and_no_residual_resolve_first(n: int) -> None:
    ops = _ops()
    parts, residual, w = _case(n, (5,), torch.float16, seed=n)
    x = ops.sum_tree(parts, torch.float16)
    got = ops.rms_norm(PendingRankSum(parts, torch.float16), w, EPS, residual)
    assert all(torch.equal(a, b) for a, b in
               zip(got, _unfused(ops, x, w, residual), strict=True))
    alone = ops.rms_norm(PendingRankSum(parts, torch.float16), w, EPS)
    assert torch.equal(alone, ops.rms_norm(x, w, EPS))
    assert torch.equal(resolved(ops, PendingRankSum(parts, torch.float16)), x)


def test_negative_control_chain_order_or_casting_first_is_another_sum() -> None:
    ops = _ops()
    parts, residual, w = _case(4, (40,), torch.float32, seed=3)
    fused = ops.rms_norm(PendingRankSum(parts, torch.float32), w, EPS, residual)
    chain = _unfused(ops, functools.reduce(torch.add, parts), w, residual)
    assert not torch.equal(fused[1], chain[1]) and not torch.equal(fused[0], chain[0])
    parts, residual, w = _case(2, (40,), torch.float16, seed=4)
    fused = ops.rms_norm(PendingRankSum(parts, torch.float16), w, EPS, residual)
    cast_first = _unfused(ops, parts[0].half() + parts[1].half(), w, residual)
    assert not torch.equal(fused[1], cast_first[1])


def test_pending_rank_sum_rejects_what_is_not_fp32_parts() -> None:
    with pytest.raises(ValueError, match="fp32 parts"):
        PendingRankSum(torch.zeros(2, 3, H, dtype=torch.float16), torch.float16)
    with pytest.raises(ValueError, match="fp32 parts"):
        PendingRankSum(torch.zeros(H), torch.float16)


# ---- a decoder whose row-parallel layers hand their sums to the norms -----------------------

WORLD = 4
SCALES = (1.0, -3.0, 0.125, 7.0)  # the simulated ranks' sums: rank 0's, scaled


class _Loopback(TPGroup):
    """Rank 0 of a WORLD-rank group in one process: every gather returns this rank's tensor
    scaled by each rank's SCALES entry, in rank order -- distinct parts for the tree sum. A
    stand-in for the other ranks (the real gloo group: tests/determinism), enough to run the
    pending path of every row-parallel layer."""

    def __init__(self) -> None:
        super().__init__(0, WORLD)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x * s for s in SCALES])


def _resolving(sum_tree=None):
    """A Triton backend that resolves every pending sum in ``gathered`` (``sum_tree`` replaced
    when given)."""
    from samebits.ops.triton.backend import TritonBackend
    cls = type("Resolving", (TritonBackend,), {"sums_in_norm": False})
    ops = cls()
    if sum_tree is not None:
        ops.sum_tree = sum_tree
    return ops


def _decoder_hidden(model, ops, lens: list[int], seed: int) -> torch.Tensor:
    """The model's hidden states over sequences of ``lens`` tokens (prefill, fresh caches)."""
    bs, hkv, d = 8, model.layers[0].self_attn.hkv, model.layers[0].self_attn.d
    need = [-(-n // bs) for n in lens]
    firsts = [sum(need[:i]) for i in range(len(lens))]
    width = max(need)
    tables = torch.tensor([[f + j for j in range(width)] for f in firsts], dtype=torch.int32)
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    slots = torch.cat([torch.arange(n) + f * bs for f, n in zip(firsts, lens, strict=True)])
    meta = AttentionMetadata(
        block_tables=tables, seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), slot_mapping=slots,
        seq_lens_list=tuple(lens), query_start_loc_list=tuple(qsl), block_size=bs,
        split_size=32)
    dtype = model.norm.dtype
    caches = [(torch.zeros(sum(need), bs, hkv, d, dtype=dtype),
               torch.zeros(sum(need), bs, hkv, d, dtype=dtype)) for _ in model.layers]
    ids = torch.randint(0, model.cfg.vocab_size, (sum(lens),),
                        generator=torch.Generator().manual_seed(seed))
    pos = torch.cat([torch.arange(n) for n in lens])
    model.ops = ops
    return model(ids, pos, caches, dataclasses.replace(ops.plan_attention(meta)))


def _decoder(dtype: torch.dtype, group: TPGroup, seed: int):
    """A two-layer Qwen3 decoder with WORLD KV heads on the Triton backend, rank 0 of ``group``."""
    from samebits.loader import build_model
    from samebits.loader.dummy import init_dummy_weights
    cfg = ModelConfig.from_dict({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 96, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": WORLD, "head_dim": 16, "rms_norm_eps": EPS,
        "max_position_embeddings": 64})
    model = build_model(cfg, _ops(), 64, "cpu", dtype, group)
    init_dummy_weights(model, seed=seed, std=0.2)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decoder_handing_its_rank_sums_to_the_norms_equals_summing_first(dtype, monkeypatch):
    from samebits.ops.triton import rms_norm as RN
    model = _decoder(dtype, _Loopback(), seed=5)
    fused = []
    monkeypatch.setattr(RN, "rank_sum_add_rms_norm",
                        lambda *a, f=RN.rank_sum_add_rms_norm: fused.append(a) or f(*a))
    lens = [1, 6]
    got = _decoder_hidden(model, _ops(), lens, seed=0)
    assert len(fused) == 2 * model.cfg.num_hidden_layers  # o_proj's and down_proj's, every layer
    assert all(a[0].count == WORLD for a in fused)
    assert torch.equal(got, _decoder_hidden(model, _resolving(), lens, seed=0))
    if dtype == torch.float32:  # negative control: the ranks' sums added in chain order
        chain = _resolving(lambda p, dt: functools.reduce(torch.add, p).to(dt))
        assert not torch.equal(got, _decoder_hidden(model, chain, lens, seed=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_device_decode_rows_hand_chain_partials_to_the_norm_with_the_linears_bits(
        dtype, monkeypatch):
    """On one device, up to ``partials_into_norm_rows`` rows, o_proj and down_proj (two K
    chains) hand the norm their chain partials: the hidden states of the linear summing them."""
    from samebits.ops.triton import rms_norm as RN
    model = _decoder(dtype, TPGroup(0, 1), seed=7)
    fused = []
    real = RN.rank_sum_add_rms_norm
    monkeypatch.setattr(RN, "rank_sum_add_rms_norm", lambda *a: fused.append(a) or real(*a))
    decode = [1, 2, 1, 3]  # 7 rows: a decode batch
    got = _decoder_hidden(model, _ops(), decode, seed=1)
    assert len(fused) == 4 and all(a[0].count == 2 for a in fused)  # 2 layers x 2 linears
    assert torch.equal(got, _decoder_hidden(model, _resolving(), decode, seed=1))
    fused.clear()
    prefill = [_ops().partials_into_norm_rows + 1]  # one row more: the linear sums them itself
    assert torch.equal(_decoder_hidden(model, _ops(), prefill, seed=2),
                       _decoder_hidden(model, _resolving(), prefill, seed=2))
    assert not fused
    if dtype == torch.float16:  # negative control: each partial cast before they are added
        def cast_first(x, residual, w, eps):
            parts = x.parts.to(x.dtype).float()
            return real(PendingRankSum(parts, x.dtype), residual, w, eps)
        monkeypatch.setattr(RN, "rank_sum_add_rms_norm", cast_first)
        assert not torch.equal(_decoder_hidden(model, _ops(), decode, seed=1), got)
