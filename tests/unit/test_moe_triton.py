"""The CUDA MoE kernels' logic on CPU under ``TRITON_INTERPRET=1`` (tiny shapes; CI has no GPU).

Route: the top-k ids of the CPU definition (ties to the lowest id), a row's bits alone equal to
its bits in a batch. Align: the one-program kernel lays assignments out exactly as the torch
path, every assignment once, every block one expert's. Experts: a token's output bits alone equal
its bits in any batch, in either layout (one block per assignment, or aligned) and under other
tiles; an expert's output is the bits of the Triton
``linear`` / ``silu_mul`` / ``linear`` on that token; the combine is torch's formula bit for bit;
all close to the CPU experts. The interpreter's ``tl.dot`` is tests/conftest.py's fixed-order
model, and it has no bf16 dot: fp32 and fp16 here; tile-shape invariance on the GPU is a Hopper
property, tested in tests/gpu/test_moe_gpu.py.
"""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit runs, i.e. at the modules' import

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

for _name in ("activation", "linear", "moe"):  # re-import under the interpreter
    if f"samebits.ops.triton.{_name}" in sys.modules:
        importlib.reload(sys.modules[f"samebits.ops.triton.{_name}"])
from samebits.ops import moe as ops_moe  # noqa: E402
from samebits.ops.triton import activation as ACT  # noqa: E402
from samebits.ops.triton import linear as L  # noqa: E402
from samebits.ops.triton import moe as M  # noqa: E402

E, H, INTER, K = 8, 64, 32, 2


def _inputs(t: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, H, generator=g).to(dtype),
            (torch.randn(E, 2 * INTER, H, generator=g) / 8).to(dtype),
            (torch.randn(E, H, INTER, generator=g) / 6).to(dtype),
            (torch.randn(t, E, generator=g) * 3).to(dtype))


def test_route_picks_the_cpu_definitions_experts_and_is_row_invariant():
    logits = _inputs(12, torch.float32)[3]
    logits[3, 5] = logits[3, 2]  # a tie: the lower id first
    w, ids = M.route(logits, K, True, True)
    want_w, want_ids = ops_moe._route(logits, K, True, True,
                                      softmax=lambda z: torch.softmax(z, -1),
                                      topk=ops_moe.topk_lowest_id)
    assert torch.equal(ids, want_ids) and torch.allclose(w, want_w, atol=1e-6)
    for i in (0, 3, 11):
        wi, idi = M.route(logits[i:i + 1], K, True, True)
        assert torch.equal(wi, w[i:i + 1]) and torch.equal(idi, ids[i:i + 1])


@pytest.mark.parametrize("tokens, block_m", [(1, 16), (7, 16), (13, 32)])
def test_align_kernel_lays_out_assignments_like_torch(tokens, block_m):
    ids = M.route(_inputs(tokens, torch.float32, seed=tokens)[3], K, False, False)[1]
    flat = ids.reshape(-1)
    got = M.align(flat, E, block_m)
    want = M._align_torch(flat.long(), E, block_m, torch.empty_like(got))
    assert torch.equal(got, want)
    real = got[got < flat.numel()]
    assert sorted(real.tolist()) == list(range(flat.numel()))
    for block in got.view(-1, block_m):
        experts = {int(flat[a]) for a in block.tolist() if a < flat.numel()}
        assert len(experts) <= 1


def _experts(x, w13, w2, w, ids, shared=None, scale=None, cfg=None, monkeypatch=None):
    if cfg is not None:
        monkeypatch.setattr(M, "pick_config", lambda *args: cfg)
    return M.fused_experts(x, w13, w2, w, shared, scale, ids=ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_experts_alone_equal_batched_under_any_tile_and_close_to_cpu(dtype, monkeypatch):
    x, w13, w2, logits = _inputs(6, dtype)
    w, ids = M.route(logits, K, True, True)
    full = _experts(x, w13, w2, w, ids)
    for i in range(6):
        assert torch.equal(_experts(x[i:i + 1], w13, w2, w[i:i + 1], ids[i:i + 1]), full[i:i + 1])
    preloads = (M.MoeGemmConfig(16, 16, 16, 4, 2, 1), M.MoeGemmConfig(16, 16, 8, 4, 2, 2))
    for other in preloads:  # one block an assignment, the down GEMM's first K tiles preloaded
        assert torch.equal(_experts(x, w13, w2, w, ids, cfg=other, monkeypatch=monkeypatch),
                           full)
    monkeypatch.undo()  # the default tiles again
    monkeypatch.setattr(M, "DIRECT_MAX", 0)  # the aligned layout instead of one per block
    assert torch.equal(_experts(x, w13, w2, w, ids), full)
    for other in (M.MoeGemmConfig(32, 16, 16, 4, 2), *preloads):
        assert torch.equal(_experts(x, w13, w2, w, ids, cfg=other, monkeypatch=monkeypatch),
                           full)
    ref = ops_moe.experts_cpu(x.float(), w13.float(), w2.float(), w, None, None, ids=ids)
    assert torch.allclose(full.float(), ref, atol=2e-3 if dtype == torch.float16 else 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_expert_output_is_the_bits_of_linear_silu_mul_linear(dtype):
    x, w13, w2, logits = _inputs(4, dtype, seed=1)
    flat = M.route(logits, K, False, False)[1].reshape(-1)
    cfg = M.pick_config(flat.numel(), E, dtype, True)
    sorted_ids = M.align(flat, E, cfg.block_m)
    act = torch.empty(flat.numel(), INTER, dtype=dtype)
    M.moe_gemm(x, w13, act, sorted_ids, flat, K, True, cfg)
    y = torch.empty(flat.numel(), H, dtype=dtype)
    M.moe_gemm(act, w2, y, sorted_ids, flat, K, False, cfg)
    for a in range(flat.numel()):
        t, e = a // K, int(flat[a])
        gu = L.linear(x[t:t + 1], w13[e])
        want_act = ACT.silu_mul(gu[:, :INTER], gu[:, INTER:])
        assert torch.equal(act[a:a + 1], want_act)
        assert torch.equal(y[a:a + 1], L.linear(want_act, w2[e]))


def test_combine_with_shared_expert_is_torchs_formula_bitwise():
    x, w13, w2, logits = _inputs(5, torch.float32, seed=2)
    w, ids = M.route(logits, K, True, False)
    shared, scale = torch.randn(5, H), torch.rand(5)
    y = torch.randn(5 * K, H)
    out = torch.empty(5, H)
    M.combine(y, w, shared, scale, out)
    want = ops_moe.combine_ordered(y.view(5, K, H), w, shared, scale, torch.float32)
    assert torch.equal(out, want)


@pytest.mark.parametrize("preload", [0, 1])  # the down GEMM's first K tile before its wait
@pytest.mark.parametrize("direct_max", [M.DIRECT_MAX, 0])  # one block per assignment; aligned
def test_a_ranks_held_experts_give_the_one_device_rows_and_skip_the_others(direct_max, preload,
                                                                            monkeypatch):
    """Expert parallel: each half of the experts (ids shifted by its first) computes exactly the
    rows of the assignments routed to it, bit for bit the one-device experts' rows, and no
    program writes another rank's rows -- also where it holds none of them, or where the batch
    is empty; the align layouts agree (kernel and torch paths)."""
    monkeypatch.setattr(M, "DIRECT_MAX", direct_max)
    if preload:  # programs that skip another rank's expert return before the loop
        cfg = M.MoeGemmConfig(16, 16, 16, 4, 2, preload)
        monkeypatch.setattr(M, "pick_config", lambda *args: cfg)
    x, w13, w2, logits = _inputs(9, torch.float32, seed=4)
    ids = M.route(logits, K, False, False)[1]
    low = ids % (E // 2)  # every assignment on the first half: the second holds none
    for routed in (ids, low):
        flat = routed.reshape(-1).to(torch.int32)
        one = M.expert_outputs(x, w13, w2, flat, K)
        for first in (0, E // 2):
            mine = (flat >= first) & (flat < first + E // 2)
            y = _held_outputs(x, w13, w2, routed, first, monkeypatch)
            assert torch.equal(y[mine], one[mine])
            assert bool(torch.isnan(y[~mine]).all()), "another rank's rows were written"
            local = torch.where(mine, flat - first, E // 2)
            got = M.align(local, E // 2, 16)
            want = M._align_torch(local.long(), E // 2, 16, torch.empty_like(got))
            assert torch.equal(got, want)
            assert sorted(got[got < flat.numel()].tolist()) == mine.nonzero()[:, 0].tolist()
    empty = _held_outputs(x[:0], w13, w2, ids[:0], E // 2, monkeypatch)
    assert empty.shape == (0, H) and M.combined(empty, torch.zeros(0, K), None, None).shape == (0, H)


def _held_outputs(x, w13, w2, ids, first, monkeypatch):
    """``expert_outputs`` of experts [first, first + E/2) (``local_ids``: the others E/2), its
    buffers starting as NaN."""
    with monkeypatch.context() as nan_start:
        nan_start.setattr(torch, "empty", _filled(torch.empty))
        flat = ops_moe.local_ids(ids, first, E // 2).to(torch.int32).contiguous()
        return M.expert_outputs(x, w13[first:first + E // 2], w2[first:first + E // 2], flat, K,
                                total=E)


def _filled(empty):
    """``torch.empty`` whose float tensors start as NaN (so unwritten rows show)."""
    def make(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    return make
