"""The rejection chain (ops/triton/rejection_chain.py) under TRITON_INTERPRET=1: it draws the
sorted definition's token on every kind of row -- near-uniform, peaked, ties straddling the top-k
and top-p cutoffs, masked, non-finite -- for every filter alone and combined; it is the chain
algorithm step for step (a torch emulation of it, the second oracle, leaves the same rows
undecided); and a row's token depends neither on its batch nor on the chunk and block sizes.
Chunks are small here so that every row spans several programs.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit runs, i.e. at the modules' import

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

pytest.importorskip("triton")

for _name in ("gumbel", "rejection_chain"):  # re-import under the interpreter if imported compiled
    _full = f"samebits.ops.triton.{_name}"
    if _full in sys.modules:
        importlib.reload(sys.modules[_full])
from samebits.engine import sampler  # noqa: E402
from samebits.engine.sampler import gumbel_noise, stream_key, weights  # noqa: E402
from samebits.ops.triton import rejection_chain as chain  # noqa: E402
from samebits.ops.triton.gumbel import stream_key as device_stream_key  # noqa: E402
from samebits.sampling_params import SamplingParams as SP  # noqa: E402

NEG = -math.inf
V = 1200
SMALL = dict(chunk=512, block=256)  # 3 chunks per row of 1200, the last one partial


def _rows(kind: str, b: int, seed: int) -> torch.Tensor:
    """b rows of logits of one kind of distribution."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, V, generator=gen)
    if kind == "uniform":
        return x * 0.01
    if kind == "peaked":
        return x * 8
    if kind == "coarse":  # ties everywhere
        return (x * 3).round()
    if kind == "top_ties":  # 300 equal top values at random places: cutoffs fall inside the tie
        top = x.amax(-1, keepdim=True) + 1
        for r in range(b):
            x[r, torch.randperm(V, generator=gen)[:300]] = top[r]
        return x
    if kind == "masked":  # grammar / min_tokens masks: 2/3 of the vocabulary at -inf
        for r in range(b):
            x[r, torch.randperm(V, generator=gen)[:2 * V // 3]] = NEG
        return x * 2
    raise ValueError(kind)


PARAMS = [SP(temperature=0.0), SP(), SP(temperature=0.7),
          SP(top_k=1), SP(top_k=7), SP(temperature=1.5, top_k=100), SP(top_k=V - 1), SP(top_k=V),
          SP(top_k=V + 5), SP(top_p=1e-6), SP(top_p=0.1), SP(temperature=0.8, top_p=0.5),
          SP(temperature=1.2, top_p=0.95), SP(top_p=1.0), SP(min_p=0.01), SP(min_p=0.5),
          SP(temperature=2.0, min_p=0.99), SP(min_p=1.0),
          SP(temperature=1.3, top_k=150, top_p=0.8), SP(top_k=350, top_p=0.6, min_p=0.3),
          SP(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02), SP(top_k=1, top_p=0.1, min_p=1.0)]


def _table(params: list[SP], seeds: list[int], index: int) -> tuple[torch.Tensor, int]:
    table, kmax = sampler.chain_table(params, seeds, [index] * len(params), V)
    return torch.tensor(table, dtype=torch.float64).view(-1, chain.COLS), kmax


def _emulated(logits: torch.Tensor, params: list[SP], seeds: list[int], index: int,
              steps: int) -> list[int]:
    """The chain in plain torch from the definition's own quantities: token per row, -1 where
    ``steps`` candidates were all rejected, -2 where the row is not finite."""
    out = []
    for r, p in enumerate(params):
        row = logits[r:r + 1]
        if not bool(torch.isfinite(row.amax())) or bool(row.isnan().any()):
            out.append(-2)
            continue
        if p.greedy:
            out.append(int(row.argmax()))
            continue
        x = row / torch.tensor([p.temperature])
        out.append(_emulated_row(x, p, stream_key(seeds[r], index), steps))
    return out


def _emulated_row(x: torch.Tensor, p: SP, key: tuple[int, int], steps: int) -> int:
    w, q = (t[0] for t in weights(x))
    s = (x + gumbel_noise(torch.tensor([key]), V))[0]
    x, ids = x[0], torch.arange(V)
    k = p.top_k if 0 < p.top_k < V else V
    top = x.topk(k).indices
    total = float(q[top].sum())
    min_p = torch.tensor(p.min_p, dtype=torch.float32)
    allowed = x >= x[top].min()
    a = int(torch.where(allowed, s, NEG).argmax())
    if k == V and p.top_p >= 1 and p.min_p == 0:
        return a
    for _ in range(steps):
        before = (x > x[a]) | ((x == x[a]) & (ids < a))
        mass = float(q[before].sum())
        if int(before.sum()) < k and (p.top_p >= 1 or not mass >= p.top_p * total) \
                and bool(w[a] >= min_p):
            return a
        allowed &= w >= min_p
        a = int(torch.where(before & allowed, s, NEG).argmax())
    return -1


@pytest.mark.parametrize("kind", [  # the default run keeps the tied distribution (CI's budget)
    "top_ties", pytest.param("uniform", marks=pytest.mark.slow),
    pytest.param("peaked", marks=pytest.mark.slow),
    pytest.param("coarse", marks=pytest.mark.slow), pytest.param("masked", marks=pytest.mark.slow)])
def test_chain_draws_the_sorted_definitions_token(kind: str) -> None:
    logits = _rows(kind, len(PARAMS), seed=len(kind))
    seeds = [31 * r + len(kind) for r in range(len(PARAMS))]
    want = sampler.sample_sorted(logits, PARAMS, seeds, [4] * len(PARAMS))
    table, kmax = _table(PARAMS, seeds, 4)
    got = chain.draw(logits, table, kmax, **SMALL)
    assert got == _emulated(logits, PARAMS, seeds, 4, chain.MAX_STEPS)
    assert all(g in (w, -1) for g, w in zip(got, want, strict=True))  # -1: drawn by the sort


def test_chain_walks_past_rejected_candidates_resumes_and_falls_back_when_out_of_steps() -> None:
    # flat rows with tight filters: the unfiltered argmax is rarely kept
    logits = _rows("uniform", 8, seed=3)
    params = [SP(top_p=0.05), SP(top_p=0.3), SP(min_p=0.995), SP(top_k=3)] * 2
    seeds = list(range(100, 108))
    want = sampler.sample_sorted(logits, params, seeds, [0] * 8)
    table, kmax = _table(params, seeds, 0)
    undecided = []
    for steps in (0, 1, 2, 5):
        got = chain.draw(logits, table, kmax, steps, steps, **SMALL)
        assert got == _emulated(logits, params, seeds, 0, steps), steps
        assert all(g in (w, -1) for g, w in zip(got, want, strict=True))
        undecided.append(got.count(-1))
    assert undecided[0] == 8  # no step: every filtered row falls back
    assert undecided[1] > undecided[2] > undecided[3] > 0
    # later rounds resume from the saved state: the same chain whatever the round boundaries
    assert chain.draw(logits, table, kmax, 1, 11, **SMALL) == _emulated(logits, params, seeds, 0, 11)
    for steps, max_steps in [(0, 0), (1, 1), (1, 11)]:
        assert sampler.sample_chained(logits, params, seeds, [0] * 8, steps, max_steps,
                                      **SMALL) == want


def test_chain_leaves_non_finite_rows_to_the_definition() -> None:
    logits = _rows("peaked", 4, seed=9)
    logits[0] = NEG  # everything masked
    logits[1, 17] = math.nan
    logits[2, 5] = math.inf
    params = [SP(top_p=0.9), SP(top_k=5), SP(min_p=0.1), SP(temperature=0.0)]
    table, kmax = _table(params, [1, 2, 3, 4], 0)
    got = chain.draw(logits, table, kmax, **SMALL)
    assert got[:3] == [-2, -2, -2] and got[3] >= 0
    want = sampler.sample_sorted(logits, params, [1, 2, 3, 4], [0] * 4)
    assert sampler.sample_chained(logits, params, [1, 2, 3, 4], [0] * 4, **SMALL) == want


def test_chain_row_token_ignores_batch_chunk_and_block() -> None:
    logits = torch.cat([_rows("top_ties", 6, seed=1), _rows("peaked", 6, seed=2)])
    params = [PARAMS[(5 * r) % len(PARAMS)] for r in range(12)]
    seeds = [7 * r for r in range(12)]
    index = [r % 3 for r in range(12)]
    batch = sampler.sample_chained(logits, params, seeds, index, **SMALL)
    assert batch == sampler.sample_sorted(logits, params, seeds, index)
    for r in (0, 7):  # one row of each kind
        one = sampler.sample_chained(logits[r:r + 1], [params[r]], [seeds[r]], [index[r]], **SMALL)
        assert one == [batch[r]], r
    order = [11, 2, 5, 0, 8]
    assert sampler.sample_chained(logits[order], [params[i] for i in order],
                                  [seeds[i] for i in order], [index[i] for i in order],
                                  chunk=512, block=64) == [batch[i] for i in order]
    assert sampler.sample_chained(logits, params, seeds, index, chunk=2048, block=256) == batch



@triton.jit
def _keys_kernel(words_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    lo = tl.load(words_ptr + 3 * i).to(tl.uint32)
    hi = tl.load(words_ptr + 3 * i + 1).to(tl.uint32)
    idx = tl.load(words_ptr + 3 * i + 2).to(tl.uint32)
    k1, k2 = device_stream_key(lo, hi, idx)
    tl.store(out_ptr + 2 * i, k1.to(tl.int64))
    tl.store(out_ptr + 2 * i + 1, k2.to(tl.int64))


def test_device_stream_key_equals_the_samplers() -> None:
    """The chain hashes each row's key on the device (gumbel.stream_key) from the seed's words
    and the index: the same words as ``sampler.stream_key`` over the whole seed range."""
    seeds = [0, 1, 7, 2**31, 2**32 - 1, 2**32, 2**40 + 12345, 2**63 - 1] * 2
    indices = [0, 1, 5, 2**31 + 3, 2**32 - 1, 2**32 + 9, 77, 123456] * 2
    table, _ = sampler.chain_table([SP()] * 16, seeds, indices, V)
    words = torch.tensor(table, dtype=torch.float64).view(16, chain.COLS)[:, 5:].to(torch.int64)
    out = torch.empty(16, 2, dtype=torch.int64)
    _keys_kernel[(1,)](words.contiguous(), out, N=16)
    assert out.tolist() == [list(stream_key(s, i)) for s, i in zip(seeds, indices, strict=True)]
