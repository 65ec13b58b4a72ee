"""The filtered Gumbel-max draw on CUDA without sorting the vocabulary: the rejection chain.

``draw(logits, table, kmax)`` returns, per row, the token ``samebits.engine.sampler`` defines
(top-k, top-p and min-p on x = logits / T, then the Gumbel-max over the kept tokens, ties to the
lowest id), or a negative number where the caller must draw the row by the sort: the chain ran out
of steps, or the row is not finite (NaN, +inf, all -inf). Greedy rows get the argmax of the logits.

Why no sort is needed: each filter keeps a *prefix* of the order (x desc, id asc) -- top-k the
ranks < k, top-p the ranks whose mass-before is below p * total (non-decreasing in rank), min-p
the tokens with w = exp(x - max) >= min_p (w is non-decreasing in x) -- so the kept set K is a
prefix, and so is ``before(a)``, the tokens ranked before a. The chain: a0 = argmax of
s = x + noise over a prefix P known to contain K; if a0 is kept it is the answer (an argmax over a
superset, kept, is the argmax over K; its tie rule too); if not, K lies inside before(a0), and
a1 = argmax of s over before(a0) & P is the next candidate; and so on. Testing a candidate a needs
only count(before(a)) < k, mass(before(a)) against p * total, and w(a) >= min_p. P: x >= the k-th
largest x for top-k rows (known from ``torch.topk`` values before the first launch); from the
second candidate on also w >= min_p.

Bits: counts and masses are integer sums (exact in any order); argmax partials are combined in
chunk order, ties to the lower id; x = div_rn(logits, T) is IEEE division like torch's ``/``;
w = libdevice expf, which torch's CUDA ``exp`` is (tests/gpu checks it on every fp32 input that
x - max can take), with libdevice's flush-to-zero off, as torch has it; the noise is gumbel.py's.
So the chunk size, the block size and the batch may change without changing a token. Under
TRITON_INTERPRET (the CPU tests) exp is torch's CPU exp, the interpreter having no libdevice.

Launches: pass 0 (s = x + noise kept in a [B, V] scratch, per-chunk max x, non-finite count,
argmax of s over P); passes 1..STEPS (each reads the row's state saved by the previous pass,
advances it with that pass's partials, and -- rows still undecided only -- counts and sums before
the current candidate and finds the next one); one program per row that writes the token; one
host sync. Rows still undecided (rare: each step is rejected with about the probability of the
mass between the kept prefix and the candidate) get later rounds of MORE_STEPS, resumed from the
saved state, up to MAX_STEPS; then the caller sorts.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from samebits.ops.triton.gumbel import noise, stream_key
from samebits.ops.triton.launcher import Launcher, aligned

STEPS = 3  # steps of the first round: candidates tested with no host sync in between
MORE_STEPS = 8  # steps of each later round, run only while some row is undecided
MAX_STEPS = 27  # then the caller draws the row by the sort
BLOCK = 1024
COLS = 8  # table columns: temperature, greedy, k, top_p, min_p, seed words (low, high), index
_TEMP, _GREEDY, _K, _TOP_P, _MIN_P, _SEED_LO, _SEED_HI, _INDEX = (tl.constexpr(i) for i in range(8))
_COLS = tl.constexpr(COLS)
_UNDECIDED, _DONE, _FALLBACK = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
_LAUNCH = dict(enable_reflect_ftz=False)  # libdevice without flush-to-zero, as torch's CUDA math

if os.environ.get("TRITON_INTERPRET") == "1":
    import numpy as np

    def _exp(x):
        """Interpreter model of libdevice expf: torch's CPU exp, all lanes on its vector path."""
        from triton.runtime.interpreter import TensorHandle
        data = np.ascontiguousarray(x.handle.data)
        flat = torch.from_numpy(data).reshape(-1)
        w = torch.exp(torch.nn.functional.pad(flat, (0, -flat.numel() % 64)))[:flat.numel()]
        return tl.core.tensor(TensorHandle(w.numpy().reshape(data.shape), x.handle.dtype.scalar),
                              x.type)
else:
    from triton.language.extra import libdevice

    @triton.jit
    def _exp(x):
        return libdevice.exp(x)


@triton.jit
def _params(table_ptr, row):
    base = table_ptr + row * _COLS
    temp = tl.load(base + _TEMP).to(tl.float32)
    greedy = tl.load(base + _GREEDY) != 0
    k = tl.load(base + _K).to(tl.int64)
    return temp, greedy, k, tl.load(base + _TOP_P), tl.load(base + _MIN_P).to(tl.float32)


@triton.jit
def _word(table_ptr, row, col):
    """A uint32 word held exactly in the fp64 table."""
    return tl.load(table_ptr + row * _COLS + col).to(tl.int64).to(tl.uint32)


@triton.jit
def _kth(vals_ptr, stride_v, row, k, V, temp):
    """The k-th largest x of a top-k row (-inf where top-k is off)."""
    on = k < V
    v = tl.load(vals_ptr + row * stride_v + tl.where(on, k - 1, 0), mask=on, other=float("-inf"))
    return tl.div_rn(v, temp)


@triton.jit
def _first_max(best, ids):
    """Combine chunk partials (best value, its id) in chunk order: the max, lowest id on ties."""
    top = tl.max(best, 0)
    return top, tl.min(tl.where(best == top, ids, 9223372036854775807), 0)


@triton.jit
def _candidate_kept(cnt, mass, total, wa, k, top_p, min_p):
    """The definition's keep test of one token, from its count and mass before it."""
    in_p = (top_p >= 1.0) | ~(mass.to(tl.float64) >= top_p * total.to(tl.float64))
    return (cnt < k) & in_p & (wa >= min_p)


@triton.jit
def _state(logits_ptr, fpart, ipart, state_ptr, row, B, C, V, stride_l, J, temp, greedy, k,
           top_p, min_p, CP: tl.constexpr):
    """A row's state once passes 0..J-1 are done: (status, candidate, its x, row max x, total
    mass). Pass J-1's state is read back from ``state_ptr`` (written by pass J-1's chunk 0) and
    advanced with pass J-1's partials: the candidate it measured is kept, or the next one."""
    c = tl.arange(0, CP)
    inside = c < C
    c4 = c * 4  # ipart holds 4 int64 per (pass, row, chunk): id, count, mass, total
    m = tl.max(tl.load(fpart + row * C + c, mask=inside, other=float("-inf")), 0)
    slot = ipart + row * C * 4 + c4
    bad = tl.sum(tl.load(slot + 1, mask=inside, other=0), 0)
    total = tl.sum(tl.load(slot + 3, mask=inside, other=0), 0)
    sa, a = _first_max(tl.load(fpart + (B + row) * C + c, mask=inside, other=float("-inf")),
                       tl.load(slot, mask=inside, other=0))
    plain = greedy | ((k >= V) & (top_p >= 1.0) & (min_p == 0.0))
    status = tl.where(plain, _DONE, _UNDECIDED)
    status = tl.where((bad > 0) | (m == float("-inf")) | (sa == float("-inf")), _FALLBACK, status)
    later = J > 1
    saved = state_ptr + ((J - 1) * B + row) * 2
    status = tl.where(later, tl.load(saved, mask=later, other=0).to(tl.int32), status)
    a = tl.where(later, tl.load(saved + 1, mask=later, other=0), a)
    live = later & (status == _UNDECIDED)
    on = c < tl.where(live, C, 0)
    total += tl.sum(tl.load(ipart + (B + row) * C * 4 + 3 + c4, mask=on, other=0), 0)
    slot = ipart + ((J - 1) * B + row) * C * 4 + c4
    cnt = tl.sum(tl.load(slot + 1, mask=on, other=0), 0)
    mass = tl.sum(tl.load(slot + 2, mask=on, other=0), 0)
    xa = tl.div_rn(tl.load(logits_ptr + row * stride_l + a, mask=live, other=0.0), temp)
    kept = _candidate_kept(cnt, mass, total, _exp(xa - m), k, top_p, min_p)
    nb, na = _first_max(tl.load(fpart + (J * B + row) * C + c, mask=on, other=float("-inf")),
                        tl.load(slot, mask=on, other=0))
    status = tl.where(live & kept, _DONE, status)
    step = live & ~kept
    status = tl.where(step & (nb == float("-inf")), _FALLBACK, status)
    a = tl.where(step, na, a)
    xa = tl.div_rn(tl.load(logits_ptr + row * stride_l + a, mask=status != _FALLBACK, other=0.0),
                   temp)
    return status, a, xa, m, total


_SIZES = ["B", "C", "V", "stride_l", "stride_v", "J"]  # not specialized: one compile per launch key


@triton.jit(do_not_specialize=_SIZES[:5])
def _draw_kernel(logits_ptr, s_ptr, table_ptr, vals_ptr, fpart, ipart, B, C, V, stride_l,
                 stride_v, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 0, one (row, chunk) per program: s = x + noise into the scratch (rows that need later
    passes), and the chunk's max x, non-finite count, argmax of s over x >= k-th largest x, and
    its share of the top-k mass (top-k rows with top-p)."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    temp, greedy, k, top_p, min_p = _params(table_ptr, row)
    k1, k2 = stream_key(_word(table_ptr, row, _SEED_LO), _word(table_ptr, row, _SEED_HI),
                        _word(table_ptr, row, _INDEX))
    chained = ~greedy & ((k < V) | (top_p < 1.0) | (min_p > 0.0))
    stored = tl.where(chained, V, 0)  # (a scalar-bool & vector mask trips the interpreter)
    vk = _kth(vals_ptr, stride_v, row, k, V, temp)
    mx, best = tl.full([], float("-inf"), tl.float32), tl.full([], float("-inf"), tl.float32)
    best_id, bad = tl.full([], 0, tl.int64), tl.full([], 0, tl.int64)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < V
        x = tl.div_rn(tl.load(logits_ptr + row * stride_l + cols, mask=inside,
                              other=float("-inf")), temp)
        s = tl.where(greedy, x, x + noise(k1, k2, cols))
        tl.store(s_ptr + row * V + cols, s, mask=cols < stored)
        bad += tl.sum(((x != x) | (x == float("inf"))).to(tl.int64), 0)
        mx = tl.maximum(mx, tl.max(x, 0))
        sc = tl.where(inside & (x >= vk), s, float("-inf"))
        block_best = tl.max(sc, 0)
        take = block_best > best  # strict: an earlier block (lower ids) keeps a tie
        best_id = tl.where(take, start + tl.argmax(sc, 0, tie_break_left=True).to(tl.int64),
                           best_id)
        best = tl.where(take, block_best, best)
    top_mass = _top_k_mass(vals_ptr, stride_v, row, chunk, k, V, top_p, temp, CHUNK, BLOCK)
    tl.store(fpart + row * C + chunk, mx)
    tl.store(fpart + (B + row) * C + chunk, best)
    slot = ipart + (row * C + chunk) * 4
    tl.store(slot, best_id)
    tl.store(slot + 1, bad)
    tl.store(slot + 2, 0)
    tl.store(slot + 3, top_mass)


@triton.jit
def _top_k_mass(vals_ptr, stride_v, row, chunk, k, V, top_p, temp, CHUNK: tl.constexpr,
                BLOCK: tl.constexpr):
    """This chunk's share of the mass of the k largest x (top-k rows with top-p; else 0): tied x
    have equal masses, so the sum over the k largest values is the top-k set's mass."""
    end = tl.where((k < V) & (top_p < 1.0), tl.minimum(chunk * CHUNK + CHUNK, k), 0)
    top = tl.div_rn(tl.load(vals_ptr + row * stride_v), temp)
    total = tl.full([], 0, tl.int64)
    for start in range(chunk * CHUNK, end, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        v = tl.load(vals_ptr + row * stride_v + idx, mask=idx < end, other=float("-inf"))
        total += tl.sum(tl.floor(_exp(tl.div_rn(v, temp) - top) * 4294967296.0).to(tl.int64), 0)
    return total


@triton.jit(do_not_specialize=_SIZES)
def _step_kernel(logits_ptr, s_ptr, table_ptr, vals_ptr, fpart, ipart, state_ptr, B, C, V, stride_l,
                 stride_v, J, CHUNK: tl.constexpr, BLOCK: tl.constexpr, CP: tl.constexpr):
    """Pass J >= 1, one (row, chunk) per program, rows still undecided only: count and mass of
    the chunk's tokens ranked before the current candidate (pass 1 also the row's mass), and the
    argmax of s over those of them in P (the next candidate)."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    temp, greedy, k, top_p, min_p = _params(table_ptr, row)
    status, a, xa, m, _ = _state(logits_ptr, fpart, ipart, state_ptr, row, B, C, V, stride_l, J,
                                 temp, greedy, k, top_p, min_p, CP)
    if chunk == 0:
        tl.store(state_ptr + (J * B + row) * 2, status.to(tl.int64))
        tl.store(state_ptr + (J * B + row) * 2 + 1, a)
    if status == _UNDECIDED:
        vk = _kth(vals_ptr, stride_v, row, k, V, temp)
        cnt, mass, total = tl.full([], 0, tl.int64), tl.full([], 0, tl.int64), tl.full([], 0, tl.int64)
        best, best_id = tl.full([], float("-inf"), tl.float32), tl.full([], 0, tl.int64)
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < V
            x = tl.div_rn(tl.load(logits_ptr + row * stride_l + cols, mask=inside,
                                  other=float("-inf")), temp)
            w = _exp(x - m)
            q = tl.floor(w * 4294967296.0).to(tl.int64)  # the integer mass
            before = inside & ((x > xa) | ((x == xa) & (cols < a)))
            cnt += tl.sum(before.to(tl.int64), 0)
            mass += tl.sum(tl.where(before, q, 0), 0)
            total += tl.sum(q, 0)
            s = tl.load(s_ptr + row * V + cols, mask=inside, other=float("-inf"))
            sc = tl.where(before & (w >= min_p) & (x >= vk), s, float("-inf"))
            block_best = tl.max(sc, 0)
            take = block_best > best
            best_id = tl.where(take, start + tl.argmax(sc, 0, tie_break_left=True).to(tl.int64),
                               best_id)
            best = tl.where(take, block_best, best)
        tl.store(fpart + ((J + 1) * B + row) * C + chunk, best)
        slot = ipart + ((J * B + row) * C + chunk) * 4
        tl.store(slot, best_id)
        tl.store(slot + 1, cnt)
        tl.store(slot + 2, mass)
        tl.store(slot + 3, tl.where((J == 1) & (k >= V), total, 0))


@triton.jit(do_not_specialize=["B", "C", "V", "stride_l", "J"])
def _decide_kernel(logits_ptr, table_ptr, fpart, ipart, state_ptr, out_ptr, B, C, V, stride_l, J,
                   CP: tl.constexpr):
    """One program per row: the first kept candidate; -1 undecided yet, -2 not finite."""
    row = tl.program_id(0)
    temp, greedy, k, top_p, min_p = _params(table_ptr, row)
    status, a, _, _, _ = _state(logits_ptr, fpart, ipart, state_ptr, row, B, C, V, stride_l, J,
                                temp, greedy, k, top_p, min_p, CP)
    tl.store(out_ptr + row, tl.where(status == _DONE, a, tl.where(status == _UNDECIDED, -1, -2)))


_DRAW, _STEP, _DECIDE = Launcher(_draw_kernel), Launcher(_step_kernel), Launcher(_decide_kernel)


def chunk_for(batch: int) -> int:
    """Tokens per program: small chunks spread a small batch over the SMs (any size, same bits)."""
    return 2048 if batch <= 4 else 8192


class ChainDraw:
    """The chain over one batch. Construction launches pass 0 and a first round of ``steps``
    steps with no host sync; ``out`` [B] int64 on the device then holds each row's token, -1 for a
    row undecided yet, or -2 for a row that is not finite (NaN, +inf, all -inf). ``finish``, given
    ``out`` as the caller read it, runs later rounds of MORE_STEPS steps while a row is undecided,
    resuming from the saved state, and returns the tokens: -1 left for rows still undecided after
    ``max_steps`` steps, which, like -2 rows, the caller draws by the sort.

    logits [B, V] fp32 (unit stride in V), table [B, COLS] fp64 per row (temperature, 1.0 if
    greedy else 0.0, k (V if top-k is off), top_p, min_p, the seed's low and high 32-bit words, the
    draw index's low word), kmax the largest k < V (0: none)."""

    def __init__(self, logits: torch.Tensor, table: torch.Tensor, kmax: int, steps: int = STEPS,
                 max_steps: int = MAX_STEPS, chunk: int | None = None, block: int = BLOCK
                 ) -> None:
        b, v = logits.shape
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        chunk = chunk or chunk_for(b)
        c = triton.cdiv(v, chunk)
        cp = triton.next_power_of_2(c)
        vals = torch.topk(logits, kmax, dim=-1).values if kmax else logits
        dev = logits.device
        s = torch.empty(b, v, dtype=torch.float32, device=dev)
        fpart = torch.empty(max_steps + 2, b, c, dtype=torch.float32, device=dev)
        ipart = torch.empty(max_steps + 1, b, c, 4, dtype=torch.int64, device=dev)
        self.state = torch.empty(max_steps + 2, b, 2, dtype=torch.int64, device=dev)
        self.out = torch.empty(b, dtype=torch.int64, device=dev)
        self.args = (logits, s, table, vals, fpart, ipart)
        self.shape = (b, c, v, logits.stride(0), vals.stride(0))
        self.key = (logits.dtype, chunk, block, cp, aligned(logits, vals, table))
        self.consts, self.max_steps, self.done = (chunk, block, cp), max_steps, 0
        _DRAW(self.key, (b, c), *self.args, *self.shape, chunk, block, **_LAUNCH)
        self._round(min(steps, max_steps))

    def _round(self, run: int) -> None:
        logits, _, table, _, fpart, ipart = self.args
        b, c, v, stride_l, _ = self.shape
        chunk, block, cp = self.consts
        for j in range(self.done + 1, self.done + run + 1):
            _STEP(self.key, (b, c), *self.args, self.state, *self.shape, j, chunk, block, cp,
                  **_LAUNCH)
        self.done += run
        _DECIDE(self.key, (b,), logits, table, fpart, ipart, self.state, self.out, b, c, v,
                stride_l, self.done + 1, cp, **_LAUNCH)

    def finish(self, tokens: list[int]) -> list[int]:
        """``tokens``: ``out`` read by the caller."""
        while -1 in tokens and self.done < self.max_steps:
            self._round(min(MORE_STEPS, self.max_steps - self.done))
            tokens = self.out.tolist()
        return tokens


def draw(logits: torch.Tensor, table: torch.Tensor, kmax: int, steps: int = STEPS,
         max_steps: int = MAX_STEPS, chunk: int | None = None, block: int = BLOCK) -> list[int]:
    """``ChainDraw``'s tokens, read at once: a token id per row, or a negative number where the
    caller must draw the row by the sort."""
    chain = ChainDraw(logits, table, kmax, steps, max_steps, chunk, block)
    return chain.finish(chain.out.tolist())
