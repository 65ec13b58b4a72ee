"""The Triton kernels' logic on CPU, under TRITON_INTERPRET=1, on tiny shapes (CI has no GPU).

Checks the invariance properties the GPU tests check (rows vs M, decode == prefill == chunks,
batch composition, physical block placement, schedules) and closeness to a torch reference.
Limits of the interpreter: its ``tl.dot`` is replaced by tests/conftest.py's fixed-order model
(each element's products added in ascending k), so tile-shape invariance here is a property of
that model -- on the GPU it is a Hopper property, tested in tests/gpu; and bf16 ``tl.dot`` is
wrong in the interpreter (Triton 3.6 and 3.9), so these tests run fp16 and fp32.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from functools import partial

os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit runs, i.e. at the modules' import

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from samebits.ops import reference  # noqa: E402
from samebits.ops.backend import AttentionMetadata, row_parallel_bounds, tree_sum  # noqa: E402

_MODULES = ["activation", "attention_kernels", "attention", "gumbel", "tree", "linear_kernels",
            "linear", "rms_norm", "rope", "softmax"]
for _name in _MODULES:  # re-import under the interpreter if something imported them compiled
    _full = f"samebits.ops.triton.{_name}"
    if _full in sys.modules:
        importlib.reload(sys.modules[_full])
from samebits.ops import rope as composed  # noqa: E402
from samebits.ops.triton import activation as ACT  # noqa: E402
from samebits.ops.triton import attention as A  # noqa: E402
from samebits.ops.triton import gumbel as G  # noqa: E402
from samebits.ops.triton import linear as L  # noqa: E402
from samebits.ops.triton import linear_tiles  # noqa: E402
from samebits.ops.triton import rms_norm as RN  # noqa: E402
from samebits.ops.triton import rope as ROPE  # noqa: E402
from samebits.ops.triton import softmax as SM  # noqa: E402

CFG = L.GemmConfig(16, 16, 64, 4, 2)


def _lin(x: torch.Tensor, w: torch.Tensor, b=None, cfg=CFG, segs=1):
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    L.run(x, w, b, out, cfg, segs)
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("k", [600, 512])
def test_linear_rows_equal_for_every_m(dtype: torch.dtype, k: int) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(40, k).to(dtype), (torch.randn(24, k) / k ** 0.5).to(dtype)
    b = torch.randn(24).to(dtype)
    ref = torch.cat([_lin(x[i:i + 1], w, b, segs=3) for i in range(40)])
    for m in (2, 15, 16, 17, 33, 40):
        assert torch.equal(_lin(x[:m], w, b, segs=3), ref[:m]), m
    perm = torch.randperm(40)
    assert torch.equal(_lin(x[perm], w, b, segs=3), ref[perm])
    exact = x.double() @ w.double().T + b.double()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert ((ref.double() - exact).norm() / exact.norm()) < tol


def test_linear_tma_kernel_matches_pointer_kernel() -> None:
    torch.manual_seed(5)
    x, w = torch.randn(37, 256).half(), (torch.randn(48, 256) / 16).half()
    b = torch.randn(48).half()
    tma = L.GemmConfig(16, 16, 64, 4, 2, tma=True)
    ref = _lin(x, w, b)
    assert torch.equal(_lin(x, w, b, cfg=tma), ref)
    assert torch.equal(_lin(x[5:9], w, b, cfg=tma), ref[5:9])


def test_a_decode_gemv_takes_the_tma_tile_only_where_the_one_segment_tma_kernel_runs() -> None:
    """Up to 8 rows, a plain one-segment product takes ``GEMV_TMA_TILE`` (the same rows as the
    pointer kernel's); chained K, an unaligned x and more rows keep the pointer tiles."""
    torch.manual_seed(6)
    x, w = torch.randn(9, 512).half(), (torch.randn(320, 512) / 16).half()  # N > a router's
    assert L.plan_of(x[:1], w).schedule == "tma" and L.plan_of(x[:8], w).schedule == "tma"
    assert L.plan_of(x[:1], w, segments=2).schedule == "split"
    assert L.plan_of(x, w).schedule == "pointer"  # 9 rows
    unaligned = torch.randn(4 * 512 + 1).half()[1:].view(4, 512)
    assert L.plan_of(unaligned, w).schedule == "pointer"
    pointer = L.GemmConfig(16, 64, 256, 4, 4)
    assert torch.equal(L.linear(x[:3], w), _lin(x[:3], w, cfg=pointer))


@pytest.mark.parametrize("segs", [2, 3, 4, 5, 8])
def test_linear_segments_are_tree_summed_with_the_bias_then_cast(segs) -> None:
    """Uniform segments (the kernel's own, a bias): the fp32 partials ``partials`` gives, added
    in tree order (the sum kernel for 2, 4, 8; torch for 3, 5), plus the bias, cast once."""
    torch.manual_seed(1)
    k = 80 * segs
    x, w = torch.randn(20, k) * torch.logspace(0, 3, k), torch.randn(40, k) / 28
    b = torch.randn(40)
    layout = L.SegmentLayout(segs, 80)
    parts = torch.empty(segs, 20, 40)
    L.run(x, w, None, parts, CFG, layout)
    want = tree_sum(parts) + b
    assert torch.equal(_lin(x, w, b, segs=layout), want)
    assert not torch.equal(_lin(x, w, b), want)  # one K chain: other bits
    h = x.half()
    L.run(h, w.half(), None, parts, CFG, layout)
    assert torch.equal(_lin(h, w.half(), b.half(), segs=layout), (tree_sum(parts) + b.half()
                                                                  .float()).half())


@pytest.mark.parametrize("m", [1, 64, 512])
def test_segmented_tiles_take_a_block_k_that_divides_every_segment(m: int) -> None:
    """Qwen3-32B's down_proj at TP 2: 4 segments of 3200 columns (12.5 steps of 256). The tile
    policy narrows BLOCK_K until every segment is whole steps (unmasked, vectorized loads)."""
    layout = L.SegmentLayout.from_bounds(row_parallel_bounds(12800, 4), 12800)
    assert not layout.even(12800, 256)
    cfg = L.segmented_config(m, 5120, 12800, torch.bfloat16, layout)
    assert layout.even(12800, cfg.block_k) and cfg.block_k >= 64
    even = L.SegmentLayout.from_bounds(row_parallel_bounds(6144, 4), 6144)  # 8B: already even
    assert L.segmented_config(m, 4096, 6144, torch.bfloat16, even).block_k == \
        (linear_tiles.segmented_tma_config(4, m) if m > L.SPLIT_MAX_M else L.pick_config(m, 4096, 6144,
                                                                          torch.bfloat16)).block_k


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # the interpreter's bf16 dot
@pytest.mark.parametrize("segs", [2, 4, 8])  # is not a product (tests/gpu covers bf16)
def test_fused_segment_tree_equals_the_split_schedule(dtype: torch.dtype, segs: int) -> None:
    """Up to SPLIT_MAX_M rows, even power-of-two segments are tree-summed in registers by one
    program per tile; its bits are the split schedule's (partials, then the sum kernel) for
    linear (bias in fp32, one cast) and linear_sum, whatever the row count."""
    torch.manual_seed(segs)
    k = 64 * segs
    x = (torch.randn(70, k) * torch.logspace(0, 2, k)).to(dtype)
    w, b = (torch.randn(40, k) / 16).to(dtype), torch.randn(40).to(dtype)
    layout = L.SegmentLayout(segs, 64)
    parts = torch.empty(segs, 70, 40)
    L.run(x, w, None, parts, CFG, layout)  # keep: the split schedule's partials
    want = (tree_sum(parts) + b.float()).to(dtype)
    for m, schedule in ((1, "split"), (16, "split"), (17, "fused tree"), (33, "fused tree"),
                        (70, "split")):
        assert L.plan_of(x[:m], w, CFG, layout).schedule == schedule, m
        assert torch.equal(_lin(x[:m], w, b, segs=layout), want[:m]), m
    bounds = tuple((s * 64, s * 64 + 64) for s in range(segs))
    assert torch.equal(L.linear_sum(x[:33], w, bounds), tree_sum(parts[:, :33]))  # fused, fp32
    chain = torch.empty(1, 70, 40)
    L.run(x, w, None, chain, CFG, 1)  # one K chain: other bits
    assert not torch.equal(chain[0], tree_sum(parts))


def test_linear_public_api() -> None:
    torch.manual_seed(1)
    x, w = torch.randn(20, 768).half(), (torch.randn(40, 768) / 28).half()
    out = L.linear(x.view(4, 5, 768), w)
    assert out.shape == (4, 5, 40)
    torch.testing.assert_close(out.view(20, 40).float(), x.float() @ w.float().T,
                               rtol=1e-2, atol=1e-2)


def _near_equal(k: int, s: int) -> tuple[tuple[int, int], ...]:
    from samebits.ops.backend import row_parallel_bounds
    return row_parallel_bounds(k, s)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("k,s", [(200, 6), (600, 3), (512, 2), (256, 8)])
def test_linear_k_bounds_is_the_tree_sum_of_segments_alone(dtype, k, s) -> None:
    """Segmented K (o_proj / down_proj): each segment's fp32 partial equals the one-segment
    product of its contiguous slice (a TP rank's), tree-summed, cast once, then the bias."""
    torch.manual_seed(6)
    x, w = torch.randn(40, k).to(dtype), (torch.randn(24, k) / k ** 0.5).to(dtype)
    b = torch.randn(24).to(dtype)
    kb = _near_equal(k, s)
    alone = [L.partials(x[:, lo:hi].contiguous(), w[:, lo:hi].contiguous(), ((0, hi - lo),))[0]
             for lo, hi in kb]
    acc = tree_sum(torch.stack(alone))
    got = L.linear(x, w, b, k_bounds=kb)
    assert torch.equal(got, acc.to(dtype) + b)
    assert torch.equal(L.partials(x, w, kb), torch.stack(alone))
    for m in (1, 7, 17):
        assert torch.equal(L.linear(x[5:5 + m], w, b, k_bounds=kb), got[5:5 + m])


@pytest.mark.parametrize("segs", [1, 2, 4, 8, 16, 64])
def test_sum_partials_kernel_is_tree_sum(segs) -> None:
    """The sum kernel's pair levels (a [segs, BLOCK] tile reshaped and summed in pairs) add
    exactly as ``tree_sum``; with the bias in fp32 before the one cast."""
    from samebits.ops.triton import linear_kernels as K
    g = torch.Generator().manual_seed(segs)
    mn, n, block = 300, 30, 128
    parts = torch.randn(segs, mn, generator=g) * torch.logspace(0, 2, mn)
    b = torch.randn(n, generator=g).half()
    out = torch.empty(mn, dtype=torch.half)
    K._sum_partials_kernel[(triton.cdiv(mn, block),)](parts, b, out, None, mn, n, segs, True,
                                                        block, False, False)
    assert torch.equal(out, (tree_sum(parts) + b.float().repeat(mn // n)).half())
    plain = torch.empty(mn)
    K._sum_partials_kernel[(triton.cdiv(mn, block),)](parts, b, plain, None, mn, n, segs, False,
                                                        block, False, False)
    assert torch.equal(plain, tree_sum(parts))
    if segs >= 4:  # negative control: the chain ((p0 + p1) + p2) ... is another sum
        chain = parts[0].clone()
        for p in parts[1:]:
            chain += p
        assert not torch.equal(plain, chain)


@pytest.mark.smoke
def test_negative_control_one_k_chain_differs_from_segments() -> None:
    torch.manual_seed(7)
    x = torch.randn(40, 600) * torch.logspace(0, 2, 600)
    w = torch.randn(24, 600) / 25
    assert not torch.equal(L.linear(x, w), L.linear(x, w, k_bounds=_near_equal(600, 3)))


def test_segment_layout_takes_only_near_equal_bounds() -> None:
    assert L.SegmentLayout.from_bounds(((0, 34), (34, 68), (68, 101)), 101) == \
        L.SegmentLayout(3, 33, 2)
    with pytest.raises(ValueError):
        L.SegmentLayout.from_bounds(((0, 10), (10, 30)), 30)
    with pytest.raises(ValueError):
        L.SegmentLayout.from_bounds(((0, 33), (33, 67)), 67)  # the longer one last


@pytest.mark.parametrize("h", [48, 300])
def test_rms_norm_rows(h: int) -> None:
    torch.manual_seed(2)
    x, r, w = torch.randn(37, h).half(), torch.randn(37, h).half(), torch.rand(h).half()
    out = RN.rms_norm(x, w, 1e-6)
    assert all(torch.equal(RN.rms_norm(x[i:i + 1], w, 1e-6), out[i:i + 1]) for i in range(37))
    torch.testing.assert_close(out, reference.rms_norm(x, w, 1e-6), rtol=2e-3, atol=2e-3)
    normed, summed = RN.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(summed, x + r) and torch.equal(normed, RN.rms_norm(x + r, w, 1e-6))
    assert torch.equal(RN.add_rms_norm(x[3:5], r[3:5], w, 1e-6)[0], normed[3:5])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_silu_mul_reads_the_gate_up_halves_and_rounds_as_torch(dtype: torch.dtype) -> None:
    """The kernel's operations (the interpreter's exp is numpy's: the expected values use it too;
    on the GPU the kernel's libdevice expf is checked against torch in tests/gpu)."""
    import numpy as np
    torch.manual_seed(4)
    t, inter = 19, 1100  # two column blocks, the second partial
    gate_up = (torch.randn(t, 2 * inter) * 6).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)  # strided views, as the MLP passes them
    out = ACT.silu_mul(gate, up)
    x = gate.float()
    e = torch.from_numpy(np.exp(-x.numpy()))
    silu = torch.div(x, 1 + e).to(dtype)
    assert out.is_contiguous() and torch.equal(out, (silu.float() * up.float()).to(dtype))
    for lo, hi in ((0, 1), (5, 12), (18, 19)):  # rows do not depend on the batch
        assert torch.equal(ACT.silu_mul(gate[lo:hi], up[lo:hi]), out[lo:hi])
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=2e-3, atol=2e-3)
    assert ACT.silu_mul(gate[:0], up[:0]).shape == (0, inter)


def _prologue_case(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, norm: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 3).to(dtype)
    freqs = torch.randint(0, 500, (t, 1), generator=g).float() * torch.rand(d // 2, generator=g)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qn = (torch.rand(d, generator=g) + 0.5).to(dtype) if norm else None
    kn = (torch.rand(d, generator=g) + 0.5).to(dtype) if norm else None
    blocks, bs = 9, 4
    slots = torch.randperm(blocks * bs, generator=g)[:t]  # scattered over the blocks
    caches = (torch.randn(blocks, bs, hkv, d, generator=g).to(dtype),
              torch.randn(blocks, bs, hkv, d, generator=g).to(dtype))
    return qkv, cos, sin, qn, kn, caches, slots


def _run_prologue(fn, case, hq: int, hkv: int, d: int):
    qkv, cos, sin, qn, kn, (kc, vc), slots = case
    kc, vc = kc.clone(), vc.clone()
    q = fn(qkv, cos, sin, qn, kn, 1e-6, kc, vc, slots, hq, hkv, d)
    return q, kc, vc


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (6, 3, 32), (2, 2, 24)])
@pytest.mark.parametrize("norm", [True, False])
def test_prologue_kernel_is_the_composition(dtype: torch.dtype, hq: int, hkv: int, d: int,
                                            norm: bool) -> None:
    """q/k norm (the rms_norm kernel's helpers), RoPE rounded as torch rounds it, the cache
    write: bitwise the composition over the rms_norm kernel, for GQA, a non-power-of-two head
    dim, token counts that are not multiples of the row tile, slots in scattered blocks."""
    for t in (1, 7, 19):
        case = _prologue_case(t, hq, hkv, d, dtype, norm, seed=t)
        assert ROPE.supports(*case[:5], *case[5], hq, hkv, d)
        got = _run_prologue(ROPE.qkv_rope_store, case, hq, hkv, d)
        want = _run_prologue(partial(composed.qkv_rope_store, RN.rms_norm), case, hq, hkv, d)
        assert got[0].shape == (t, hq, d) and got[0].is_contiguous()
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (t, hq, hkv, d)


def test_prologue_rows_do_not_depend_on_the_batch() -> None:
    hq, hkv, d = 4, 2, 32
    qkv, cos, sin, qn, kn, (kc, vc), slots = _prologue_case(19, hq, hkv, d, torch.float16, True, 7)
    full = _run_prologue(ROPE.qkv_rope_store, (qkv, cos, sin, qn, kn, (kc, vc), slots), hq, hkv, d)
    for lo, hi in ((0, 1), (3, 10), (17, 19)):
        part = _run_prologue(ROPE.qkv_rope_store, (qkv[lo:hi], cos[lo:hi], sin[lo:hi], qn, kn,
                                                   (kc, vc), slots[lo:hi]), hq, hkv, d)
        assert torch.equal(part[0], full[0][lo:hi])
        for cache, whole in zip(part[1:], full[1:], strict=True):
            flat, flat_whole = cache.view(-1, hkv, d), whole.view(-1, hkv, d)
            assert torch.equal(flat[slots[lo:hi]], flat_whole[slots[lo:hi]])


def _numpy_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """torch's SiLU-then-multiply with the interpreter's exp (numpy's) in place of torch's."""
    import numpy as np
    x = gate.float()
    silu = torch.div(x, 1 + torch.from_numpy(np.exp(-x.numpy()))).to(gate.dtype)
    return (silu.float() * up.float()).to(gate.dtype)


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_decoder_on_the_triton_backend_equals_the_unfused_forward(arch: str) -> None:
    """The whole decoder over the Triton backend (fp16): fused norm + residual, prologue and
    SiLU kernels against the forward before fusion, hidden states and caches."""
    from samebits.config import ModelConfig
    from samebits.loader import build_model
    from samebits.loader.dummy import init_dummy_weights
    from samebits.ops.triton.backend import TritonBackend
    from tests.unfused import unfused_forward
    cfg = ModelConfig.from_dict({
        "architectures": [arch], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 128})
    model = build_model(cfg, TritonBackend(), 128, "cpu", torch.float16)
    init_dummy_weights(model, seed=2, std=0.1)
    lens = [1, 7, 20]
    cache = Paged(lens, 2, 16, torch.float16, seed=1)
    meta = cache.meta([0, 1, 2], lens, lens)
    slots = [meta.block_tables[b, torch.arange(n) // cache.bs].long() * cache.bs
             + torch.arange(n) % cache.bs for b, n in enumerate(lens)]
    meta = dataclasses.replace(meta, slot_mapping=torch.cat(slots))
    ids = torch.randint(0, 128, (sum(lens),), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lens])
    fused = [(torch.zeros_like(cache.k), torch.zeros_like(cache.v)) for _ in range(2)]
    old = [(torch.zeros_like(cache.k), torch.zeros_like(cache.v)) for _ in range(2)]
    meta = model.ops.plan_attention(meta)
    hidden = model(ids, pos, fused, meta)
    assert torch.equal(hidden, unfused_forward(model, ids, pos, old, meta, _numpy_silu_mul))
    for (k, v), (k_old, v_old) in zip(fused, old, strict=True):
        assert torch.equal(k, k_old) and torch.equal(v, v_old)


@pytest.mark.parametrize("n", [100, 9000, 40000])
def test_softmax_rows(n: int) -> None:
    torch.manual_seed(3)
    x = torch.randn(9, n) * 4
    x[2, :7] = float("-inf")
    x[3, :min(20000, n // 2)] = float("-inf")  # a whole chunk of -inf when the row is chunked
    for fn, ref in ((SM.softmax, torch.softmax), (SM.log_softmax, torch.log_softmax)):
        out = fn(x)
        assert all(torch.equal(fn(x[i:i + 1]), out[i:i + 1]) for i in range(9))
        torch.testing.assert_close(out, ref(x, -1), rtol=1e-5, atol=1e-5)


class Paged:
    def __init__(self, lens: list[int], hkv: int, d: int, dtype: torch.dtype, bs: int = 8,
                 seed: int = 0, spare: int = 3):
        g = torch.Generator().manual_seed(seed)
        need = [-(-n // bs) for n in lens]
        nb = sum(need) + spare
        self.k = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
        self.v = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
        perm = torch.randperm(nb, generator=g).tolist()
        self.bs, self.tables = bs, []
        for n in need:
            self.tables.append(perm[:n])
            perm = perm[n:]

    def meta(self, seqs: list[int], seq_lens: list[int], q_lens: list[int], split: int = 32):
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        tables = [self.tables[s] for s in seqs]
        width = max(len(t) for t in tables)
        return AttentionMetadata(
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                      dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64), seq_lens_list=tuple(seq_lens),
            query_start_loc_list=tuple(qsl), block_size=self.bs, split_size=split)


@pytest.mark.parametrize("split", [32, 48])
@pytest.mark.parametrize("hq,hkv,dtype", [(4, 2, torch.float16), (2, 2, torch.float32),
                                          (3, 1, torch.float16)])
def test_attention_decode_equals_prefill(hq: int, hkv: int, dtype: torch.dtype, split: int
                                         ) -> None:
    """Split 32 is one key block per split (the default's shape: split 128 = one 128-key block);
    split 48 is three 16-key blocks with an online softmax inside the split."""
    n, d = 75, 32
    assert A.key_block(split) == (32 if split == 32 else 16)
    cache = Paged([n], hkv, d, dtype)
    q = torch.randn(n, hq, d).to(dtype)
    meta = cache.meta([0], [n], [n], split=split)
    planned = dataclasses.replace(meta, plan=A.plan(meta))
    pre = A.attention(q, cache.k, cache.v, planned, d ** -0.5)
    dec = A.attention(q, cache.k, cache.v,
                      cache.meta([0] * n, list(range(1, n + 1)), [1] * n, split=split), d ** -0.5)
    assert torch.equal(pre, dec)
    ref = reference.attention(q.double(), cache.k.double(), cache.v.double(), meta, d ** -0.5)
    assert (pre.double() - ref).abs().max() < (1e-5 if dtype == torch.float32 else 3e-3)


def test_attention_chunks_schedules_batch_and_blocks() -> None:
    hq, hkv, d = 4, 2, 32
    lens, q_lens = [75, 20, 40], [75, 3, 17]
    cache = Paged(lens, hkv, d, torch.float16, seed=1)
    qs = [torch.randn(n, hq, d).half() for n in q_lens]
    alone = [A.attention(qs[i], cache.k, cache.v, cache.meta([i], [lens[i]], [q_lens[i]]),
                         d ** -0.5) for i in range(3)]
    start = 0
    for c in (1, 7, 24, 9, 34):  # chunked prefill of sequence 0
        out = A.attention(qs[0][start:start + c], cache.k, cache.v,
                          cache.meta([0], [start + c], [c]), d ** -0.5)
        assert torch.equal(out, alone[0][start:start + c]), (start, c)
        start += c
    meta = cache.meta([2, 0, 1], [lens[2], lens[0], lens[1]], [q_lens[2], q_lens[0], q_lens[1]])
    batch = torch.cat([qs[2], qs[0], qs[1]])
    for kwargs, scan in ((dict(block_m=16, min_prefill=1), False),
                         (dict(block_m=32, min_prefill=10 ** 9), True),
                         (dict(block_m=32, min_prefill=10 ** 9), False),
                         (dict(block_m=64, min_prefill=16), False)):
        launch = dataclasses.replace(A.DEFAULT_LAUNCH, merge_scan=scan)
        plan = A.plan(meta, launch=launch, **kwargs)
        out = A.attention(batch, cache.k, cache.v, dataclasses.replace(meta, plan=plan),
                          d ** -0.5)
        assert torch.equal(out, torch.cat([alone[2], alone[0], alone[1]])), (kwargs, scan)
    moved = Paged(lens, hkv, d, torch.float16, seed=7, spare=5)
    for i, n in enumerate(lens):  # same logical KV, other physical blocks
        for p in range(n):
            src, dst = cache.tables[i][p // 8], moved.tables[i][p // 8]
            moved.k[dst, p % 8], moved.v[dst, p % 8] = cache.k[src, p % 8], cache.v[src, p % 8]
    out = A.attention(qs[0], moved.k, moved.v, moved.meta([0], [75], [75]), d ** -0.5)
    assert torch.equal(out, alone[0])


def test_attention_graph_decode_plan_padding_and_wide_grid_keep_bits() -> None:
    """The CUDA-graph decode plan (caller-owned tensors, padding rows on a scratch block, a split
    grid wider than any token needs) gives the eager plan's bits for the real rows."""
    hq, hkv, d = 4, 2, 32
    lens = [75, 20, 40]
    cache = Paged(lens, hkv, d, torch.float16, seed=3, spare=2)
    scratch = cache.k.shape[0] - 1
    q = torch.randn(len(lens) + 2, hq, d).half()
    eager = A.attention(q[:3], cache.k, cache.v, cache.meta([0, 1, 2], lens, [1, 1, 1]), d ** -0.5)
    meta = cache.meta([0, 1, 2], lens, [1, 1, 1])
    width = 16
    tables = [t + [scratch] * (width - len(t)) for t in cache.tables] + [[scratch] * width] * 2
    meta = dataclasses.replace(
        meta, block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor(lens + [1, 1], dtype=torch.int32),
        query_start_loc=torch.arange(6, dtype=torch.int32), seq_lens_list=(128,) * 5,
        query_start_loc_list=tuple(range(6)))
    positions = torch.tensor([n - 1 for n in lens] + [0, 0], dtype=torch.int32)
    planned = dataclasses.replace(meta, plan=A.plan_decode(meta, positions, max_splits=4))
    graph = A.attention(q, cache.k, cache.v, planned, d ** -0.5)
    assert torch.equal(graph[:3], eager)


def test_standard_cuda_backend_matches_reference_and_picks_split_from_batch() -> None:
    """The CUDA standard backend's logic (flash-decoding with a batch-chosen split, SDPA for
    prefill) computes attention, with a split size that follows the batch."""
    from samebits.ops.standard_cuda import StandardCudaBackend, decode_split_size
    assert decode_split_size(1, 32768, 132) == 256
    assert decode_split_size(64, 1280, 132) == 512
    assert decode_split_size(128, 4096, 132) == 2048
    assert decode_split_size(256, 4096, 132) == 4096
    hq, hkv, d = 4, 2, 32
    lens = [75, 20, 40]
    cache = Paged(lens, hkv, d, torch.float32, seed=5)
    std = StandardCudaBackend()
    for q_lens in ([1, 20, 1], [1, 7, 1]):  # a prompt from position 0; a chunk after context
        q = torch.randn(sum(q_lens), hq, d)
        meta = cache.meta([0, 1, 2], lens, q_lens)
        out = std.attention(q, cache.k, cache.v, std.plan_attention(meta), d ** -0.5)
        ref = reference.attention(q.double(), cache.k.double(), cache.v.double(), meta,
                                  d ** -0.5)
        assert (out.double() - ref).abs().max() < 1e-5, q_lens


def test_gumbel_argmax_kernel_draws_the_samplers_token_per_row() -> None:
    from samebits.engine.sampler import gumbel_noise, stream_key
    gen = torch.Generator().manual_seed(3)
    v = G.CHUNK + 1500  # two chunks, the second partial
    x = torch.randn(6, v, generator=gen) * torch.tensor([0.01, 0.5, 1, 2, 4, 8])[:, None]
    x[5] = 0.0  # all tied: the noise alone decides
    keep = torch.rand(6, v, generator=gen) < 0.7
    keys = torch.tensor([stream_key(100 + r, 7) for r in range(6)])
    want = (x.masked_fill(~keep, float("-inf")) + gumbel_noise(keys, v)).argmax(-1)
    got = G.gumbel_argmax(x, keep, keys)
    assert got.tolist() == want.tolist()
    assert keep.gather(1, got[:, None]).all()
    for r in range(6):  # a row alone
        assert G.gumbel_argmax(x[r:r + 1], keep[r:r + 1], keys[r:r + 1]).item() == got[r].item()
