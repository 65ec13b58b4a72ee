"""``samebits.ops.backend.tree_sum``'s balanced tree inside a Triton kernel, one leaf at a time:
kernels that produce partials in order (K segments, gathered rank sums) add them as they come, in
the tree's order, on a stack of up to four pending subtree sums (trees of up to 16 leaves).

``tree_leaf`` walks the tree in post order at compile time: leaf s is pushed onto ``depth``
entries, then ``merges`` times the top two are replaced by their sum (lower entry + top). After
the last leaf, entry 0 holds the tree's sum."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.constexpr_function
def tree_leaf(n, s):
    """16 * depth + merges for leaf ``s`` of the tree over ``n`` leaves (tree(p[lo..hi)) =
    tree(p[lo..h)) + tree(p[h..hi)), h = lo + ceil((hi - lo) / 2))."""
    steps = []
    depth = 0
    todo = [(0, n, False)]  # (lo, hi, children done): an explicit post-order walk
    while todo:
        lo, hi, done = todo.pop()
        if hi - lo == 1:
            steps.append([depth, 0])
            depth += 1
        elif done:
            steps[-1][1] += 1
            depth -= 1
        else:
            h = lo + (hi - lo + 1) // 2
            todo += [(lo, hi, True), (h, hi, False), (lo, h, False)]
    return 16 * steps[s][0] + steps[s][1]


@triton.jit
def _slot(s0, s1, s2, s3, AT: tl.constexpr):
    """Stack entry ``AT`` (a compile-time index) of the four named entries."""
    if AT == 0:
        v = s0
    elif AT == 1:
        v = s1
    elif AT == 2:
        v = s2
    else:
        v = s3
    return v


@triton.constexpr_function
def _top(n, s):
    """The entry leaf ``s`` of ``n`` lands on once its merges are done."""
    code = tree_leaf(n, s)
    return code // 16 - code % 16


@triton.jit
def _merged(v, s0, s1, s2, s3, NUM: tl.constexpr, LEAF: tl.constexpr):
    """Leaf LEAF's value ``v`` after the tree's merges that end at it."""
    tl.static_assert(NUM <= 16, "the stack holds four entries: trees of up to 16 leaves")
    CODE: tl.constexpr = tree_leaf(NUM, LEAF)
    DEPTH: tl.constexpr = CODE // 16
    for j in tl.static_range(CODE % 16):
        v = _slot(s0, s1, s2, s3, DEPTH - 1 - j) + v
    return v


@triton.jit
def _put(v, s0, s1, s2, s3, AT: tl.constexpr):
    """The stack with entry ``AT`` (a compile-time index) set to ``v``."""
    if AT == 0:
        s0 = v
    elif AT == 1:
        s1 = v
    elif AT == 2:
        s2 = v
    else:
        s3 = v
    return s0, s1, s2, s3


@triton.jit
def tree_push(v, s0, s1, s2, s3, NUM: tl.constexpr, LEAF: tl.constexpr):
    """Push leaf LEAF (a compile-time index) of NUM; returns the stack (s0 .. s3, bottom
    first)."""
    v = _merged(v, s0, s1, s2, s3, NUM, LEAF)
    return _put(v, s0, s1, s2, s3, _top(NUM, LEAF))


@triton.jit
def tree_step(acc, s0, s1, s2, s3, take, NUM: tl.constexpr, LEAF: tl.constexpr):
    """``tree_push`` where the scalar ``take`` holds (``acc`` is leaf LEAF), the stack unchanged
    elsewhere. Branch-free (selects): a branch here makes the compiler copy an accumulator whose
    MMA is in flight."""
    v = _merged(acc, s0, s1, s2, s3, NUM, LEAF)
    TOP: tl.constexpr = _top(NUM, LEAF)
    return _put(tl.where(take, v, _slot(s0, s1, s2, s3, TOP)), s0, s1, s2, s3, TOP)
