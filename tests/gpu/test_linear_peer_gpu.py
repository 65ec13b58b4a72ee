"""``linear_sum(x, w, k_bounds, out=, peer_out=)`` compiled on one GPU: the kernel that stores a
rank's fp32 sum stores each tile into ``peer_out`` too (``SAMEBITS_TP_PUSH=2``'s peer store; here
``peer_out`` is a local tensor standing in for the peer's slot). Skipped without CUDA.

What the tests prove, bit for bit: for every schedule ``linear_sum`` takes -- one segment (the
split program's one partial), the split schedule (the sum kernel; torch's tree for 3 segments),
the fused tree (17-64 rows) and the segmented TMA kernel (65+ rows, its tile's shared memory
budgeted for the peer store) -- ``out`` and ``peer_out`` (slots at an offset in NaN-filled
buffers, as in a ring) both hold the bits ``linear_sum`` returns without them, and no other
element of either buffer changes; eager and with programmatic launch (``as_captured``), and
replayed from a CUDA graph over new inputs. Negative control: the sum of another input differs.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from samebits.ops.backend import row_parallel_bounds  # noqa: E402
from samebits.ops.triton import launcher  # noqa: E402
from samebits.ops.triton import linear as L  # noqa: E402

ROWS = [1, 7, 33, 64, 65, 200, 300, 2048]
# (K a rank holds, its segments, H): Qwen3-8B's o_proj / down_proj at TP 2 and 4 KV-group shapes
SHAPES = [(2048, 4, 4096), (6144, 4, 4096), (2048, 1, 4096), (3072, 3, 1024), (4096, 8, 1024),
          (4096, 2, 1024)]


def _data(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g) * torch.logspace(0, 2, k, device="cuda")
    w = torch.randn(n, k, device="cuda", generator=g) / k ** 0.5
    return x.bfloat16(), w.bfloat16()


def _slots(m: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two NaN-filled buffers of two [m, n] slots each: out is the first's slot 1, peer_out the
    second's slot 0 (rank 1's slot in its own ring and in its peer's)."""
    size = m * n
    mine, theirs = (torch.full((2 * size,), float("nan"), device="cuda") for _ in range(2))
    return mine, mine[size:].view(m, n), theirs, theirs[:size].view(m, n)


def _check(x, w, kb, want) -> bool:
    mine, out, theirs, peer = _slots(x.shape[0], w.shape[0])
    L.linear_sum(x, w, kb, out=out, peer_out=peer)
    untouched = mine[:out.numel()].isnan().all() and theirs[peer.numel():].isnan().all()
    return bool(torch.equal(out, want) and torch.equal(peer, want) and untouched)


@pytest.mark.parametrize("k,s,n", SHAPES)
def test_out_and_peer_out_hold_linear_sums_bits_in_every_schedule(k, s, n):
    kb = row_parallel_bounds(k, s)
    layout = L.SegmentLayout.from_bounds(kb, k)
    x, w = _data(max(ROWS), k, n, seed=k + s)
    schedules = set()
    for m in ROWS:
        want = L.linear_sum(x[:m], w, kb)
        assert _check(x[:m], w, kb, want), m
        with launcher.as_captured():  # the graph variants: programmatic launch
            assert _check(x[:m], w, kb, want), ("pdl", m)
        cfg = L.segmented_config(m, n, k, x.dtype, layout)
        schedules.add(L.plan_of(x[:m], w, cfg, layout).schedule if s > 1 else "one segment")
    if s > 1:
        assert {"split", "segmented tma"} <= schedules
        assert ("fused tree" in schedules) == (s in (2, 4, 8)), schedules


@pytest.mark.parametrize("m", [1, 33, 300])
def test_peer_stores_replayed_from_a_cuda_graph_hold_the_new_inputs_bits(m):
    k, s, n = 2048, 4, 4096
    kb = row_parallel_bounds(k, s)
    static, w = _data(m, k, n, seed=m)
    mine, out, theirs, peer = _slots(m, n)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), launcher.as_captured():
        L.linear_sum(static, w, kb, out=out, peer_out=peer)  # compiles the captured variants
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), launcher.as_captured():
        L.linear_sum(static, w, kb, out=out, peer_out=peer)
    before = L.linear_sum(static, w, kb)
    for seed in range(3):
        x, _ = _data(m, k, n, seed=100 + seed)
        static.copy_(x)
        graph.replay()
        want = L.linear_sum(x, w, kb)
        assert torch.equal(out, want) and torch.equal(peer, want)
        assert not torch.equal(peer, before)  # negative control: another input, other bits
