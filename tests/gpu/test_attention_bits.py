"""Bits of the Triton paged attention: decode == prefill == chunked prefill, for any batch, any
physical block placement, any tile schedule; split and key-block boundaries; GQA.

Negative control: SDPA on the same data laid out contiguously does change with the schedule.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from samebits.ops.backend import AttentionMetadata  # noqa: E402
from samebits.ops.triton import attention as A  # noqa: E402
from tests.gpu.findings import record  # noqa: E402

BS = 16


class Paged:
    """A paged KV cache holding sequences of given lengths at shuffled physical blocks."""

    def __init__(self, lens: list[int], hkv: int, d: int, dtype: torch.dtype, seed: int = 0,
                 bs: int = BS, spare: int = 7):
        g = torch.Generator(device="cuda").manual_seed(seed)
        need = [-(-n // bs) for n in lens]
        nb = sum(need) + spare
        self.k = torch.randn(nb, bs, hkv, d, device="cuda", generator=g).to(dtype)
        self.v = torch.randn(nb, bs, hkv, d, device="cuda", generator=g).to(dtype)
        perm = torch.randperm(nb, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables, self.bs = [], bs
        for n in need:
            self.tables.append(perm[:n])
            perm = perm[n:]

    def meta(self, seqs: list[int], seq_lens: list[int], q_lens: list[int],
             split: int = 128) -> AttentionMetadata:
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        tables = [self.tables[s] for s in seqs]
        width = max(len(t) for t in tables)
        bt = [t + [0] * (width - len(t)) for t in tables]
        return AttentionMetadata(
            block_tables=torch.tensor(bt, dtype=torch.int32, device="cuda"),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device="cuda"),
            slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64, device="cuda"),
            seq_lens_list=tuple(seq_lens), query_start_loc_list=tuple(qsl), block_size=self.bs,
            split_size=split)

    def contiguous(self, seq: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(n, device="cuda")
        blocks = torch.tensor(self.tables[seq], device="cuda")[pos // self.bs]
        return self.k[blocks, pos % self.bs], self.v[blocks, pos % self.bs]  # [n, Hkv, D]


def _decode_all(cache: Paged, q: torch.Tensor, seq: int, positions: list[int], split: int = 128,
                launch: A.AttentionLaunch = A.DEFAULT_LAUNCH):
    """Each position as a one-query sequence, all in one batch (split path)."""
    meta = cache.meta([seq] * len(positions), [p + 1 for p in positions], [1] * len(positions),
                      split)
    meta = dataclasses.replace(meta, plan=A.plan(meta, launch=launch))
    return A.attention(q[positions], cache.k, cache.v, meta, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (8, 8, 64), (16, 2, 128), (12, 4, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gluon", [False, True])
@pytest.mark.parametrize("split", [128, 256])
def test_decode_equals_prefill(hq: int, hkv: int, d: int, dtype: torch.dtype, gluon: bool,
                               split: int) -> None:
    """Split 128 (the default) is one 128-key block per split; split 256 is two 128-key blocks
    with an online softmax inside the split."""
    n = 1100  # split boundaries every 128 / 256 keys
    cache = Paged([n], hkv, d, dtype)
    q = torch.randn(n, hq, d, device="cuda").to(dtype)
    scale = d ** -0.5
    pre = A.attention(q, cache.k, cache.v, cache.meta([0], [n], [n], split), scale)
    launch = dataclasses.replace(A.DEFAULT_LAUNCH, decode_gluon=gluon,
                                 split_warps=4 if gluon else 2, merge_scan=gluon)
    dec = _decode_all(cache, q, 0, list(range(n)), split, launch)
    bad = (pre != dec).flatten(1).any(1).nonzero().flatten().tolist()
    assert bad == [], f"positions differing: {bad[:10]}"
    k, v = cache.contiguous(0, n)
    ref = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
        is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
    assert (pre.float() - ref).abs().max() < 2e-2


def test_chunked_prefill_and_schedules() -> None:
    hq, hkv, d, n = 32, 8, 128, 1300
    cache = Paged([n], hkv, d, torch.bfloat16, seed=1)
    q = torch.randn(n, hq, d, device="cuda").bfloat16()
    pre = A.attention(q, cache.k, cache.v, cache.meta([0], [n], [n]), d ** -0.5)
    chunks = [1, 15, 16, 17, 63, 64, 65, 255, 1, 256, 257, 2, 288]
    assert sum(chunks) == n
    start = 0
    for c in chunks:  # each chunk alone: seq_len = end of chunk
        meta = cache.meta([0], [start + c], [c])
        out = A.attention(q[start:start + c], cache.k, cache.v, meta, d ** -0.5)
        assert torch.equal(out, pre[start:start + c]), (start, c)
        start += c
    meta = cache.meta([0], [n], [n])
    for gluon, scan, warps in ((False, False, 2), (False, True, 4), (True, False, 4),
                               (True, True, 8)):  # split path variants
        launch = dataclasses.replace(A.DEFAULT_LAUNCH, decode_gluon=gluon, merge_scan=scan,
                                     split_warps=warps)
        p = A.plan(meta, min_prefill=10 ** 9, launch=launch)
        out = A.attention(q, cache.k, cache.v, dataclasses.replace(meta, plan=p), d ** -0.5)
        assert torch.equal(out, pre), (gluon, scan, warps)
    for block_m in (64, 128):
        for min_prefill in (1, 16, 10 ** 9):
            p = A.plan(meta, block_m=block_m, min_prefill=min_prefill)
            m2 = dataclasses.replace(meta, plan=p)
            out = A.attention(q, cache.k, cache.v, m2, d ** -0.5)
            assert torch.equal(out, pre), (block_m, min_prefill)


def test_batch_composition_and_block_placement() -> None:
    hq, hkv, d = 32, 8, 128
    lens = [700, 33, 1, 257, 4000, 90]
    cache = Paged(lens, hkv, d, torch.bfloat16, seed=2)
    q_lens = [700, 5, 1, 1, 16, 90]
    qs = [torch.randn(ql, hq, d, device="cuda").bfloat16() for ql in q_lens]
    alone = [A.attention(qs[i], cache.k, cache.v, cache.meta([i], [lens[i]], [q_lens[i]]),
                         d ** -0.5) for i in range(len(lens))]
    order = [4, 0, 5, 2, 3, 1]
    meta = cache.meta(order, [lens[i] for i in order], [q_lens[i] for i in order])
    out = A.attention(torch.cat([qs[i] for i in order]), cache.k, cache.v, meta, d ** -0.5)
    row = 0
    for i in order:
        assert torch.equal(out[row:row + q_lens[i]], alone[i]), i
        row += q_lens[i]
    moved = Paged(lens, hkv, d, torch.bfloat16, seed=99, spare=40)  # other physical blocks
    for i, n in enumerate(lens):
        k, v = cache.contiguous(i, n)
        pos = torch.arange(n, device="cuda")
        blocks = torch.tensor(moved.tables[i], device="cuda")[pos // BS]
        moved.k[blocks, pos % BS], moved.v[blocks, pos % BS] = k, v
    out2 = A.attention(qs[4], moved.k, moved.v, moved.meta([4], [lens[4]], [q_lens[4]]),
                       d ** -0.5)
    assert torch.equal(out2, alone[4])


@pytest.mark.parametrize("split,bs", [(128, 16), (256, 32), (512, 8)])
def test_other_split_and_block_sizes(split: int, bs: int) -> None:
    hq, hkv, d, n = 16, 4, 128, 1100
    cache = Paged([n], hkv, d, torch.bfloat16, seed=3, bs=bs)
    q = torch.randn(n, hq, d, device="cuda").bfloat16()
    pre = A.attention(q, cache.k, cache.v, cache.meta([0], [n], [n], split), d ** -0.5)
    pos = [0, 1, 63, 64, split - 1, split, split + 1, 2 * split, n - 1]
    assert torch.equal(_decode_all(cache, q, 0, pos, split), pre[pos])


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs", [16, 32, 128])
def test_gluon_prefill_equals_triton_prefill(d: int, dtype: torch.dtype, bs: int) -> None:
    """The warp-specialized Gluon prefill (Hopper) and the Triton prefill kernel, same plan:
    whole prompts, chunks starting mid-block, a one-tile sequence, sequences ending mid-page."""
    if not A._gluon_device(torch.device("cuda")):
        pytest.skip("the Gluon prefill kernel runs on Hopper (sm_90) only")
    hq, hkv = 16, 4
    lens, q_lens = [1100, 300, 129, 2000, 77], [1100, 200, 17, 1000, 77]
    cache = Paged(lens, hkv, d, dtype, seed=4, bs=bs)
    meta = cache.meta(list(range(len(lens))), lens, q_lens)
    q = torch.randn(sum(q_lens), hq, d, device="cuda").to(dtype)
    p = A.plan(meta, block_m=128)
    assert A._gluon_fits(q, meta, p)
    gluon = A.attention(q, cache.k, cache.v, dataclasses.replace(meta, plan=p), d ** -0.5)
    p = dataclasses.replace(p, launch=dataclasses.replace(A.DEFAULT_LAUNCH, prefill_gluon=False))
    triton_ = A.attention(q, cache.k, cache.v, dataclasses.replace(meta, plan=p), d ** -0.5)
    bad = (gluon != triton_).flatten(1).any(1).nonzero().flatten().tolist()
    assert bad == [], f"rows differing: {bad[:10]} of {len(bad)}"


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (8, 8, 64), (16, 2, 128), (64, 1, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs", [16, 64])
def test_gluon_decode_equals_triton_decode(hq: int, hkv: int, d: int, dtype: torch.dtype,
                                           bs: int) -> None:
    """The Gluon split kernel (Hopper) and the Triton split kernel (transposed products): the
    same partials, so the same outputs, at positions around page and split boundaries."""
    if not A._gluon_device(torch.device("cuda")):
        pytest.skip("the Gluon split kernel runs on Hopper (sm_90) only")
    n = 700
    cache = Paged([n], hkv, d, dtype, seed=6, bs=bs)
    q = torch.randn(n, hq, d, device="cuda").to(dtype)
    pos = [0, 1, 15, 16, 17, 126, 127, 128, 129, 255, 256, 300, 511, 512, 640, n - 1]
    assert A._gluon_decode_fits(q, cache.meta([0], [n], [1]), A.plan(cache.meta([0], [n], [1])),
                                hq // hkv)
    gluon = _decode_all(cache, q, 0, pos)
    triton_ = _decode_all(cache, q, 0, pos,
                          launch=dataclasses.replace(A.DEFAULT_LAUNCH, decode_gluon=False))
    bad = [p for i, p in enumerate(pos) if not torch.equal(gluon[i], triton_[i])]
    assert bad == [], f"positions differing: {bad}"


def test_sdpa_negative_control() -> None:
    """SDPA (flash) decode vs prefill, and decode at batch 1 vs 8, on contiguous K/V."""
    hq, hkv, d, n = 32, 8, 128, 2048
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(1, hq, n, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, hkv, n, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, hkv, n, d, device="cuda", generator=g).bfloat16()
    pre = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    pos = list(range(0, n, 97)) + [n - 1]
    dec_diff = sum(not torch.equal(F.scaled_dot_product_attention(
        q[:, :, p:p + 1], k[:, :, :p + 1], v[:, :, :p + 1], enable_gqa=True), pre[:, :, p:p + 1])
        for p in pos)
    one = F.scaled_dot_product_attention(q[:, :, -1:], k, v, enable_gqa=True)
    many = F.scaled_dot_product_attention(q[:, :, -1:].expand(8, -1, -1, -1).contiguous(),
                                          k.expand(8, -1, -1, -1), v.expand(8, -1, -1, -1),
                                          enable_gqa=True)
    batch_diff = sum(not torch.equal(many[i:i + 1], one) for i in range(8))
    record("attention_negative_control", decode_vs_prefill_differs=dec_diff, of=len(pos),
           batch8_vs_batch1_differs=batch_diff)
    assert dec_diff + batch_diff > 0, "SDPA gave the same bits: this control proves nothing here"
