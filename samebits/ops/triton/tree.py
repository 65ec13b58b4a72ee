"""The balanced tree of ``samebits.ops.backend.tree_sum`` inside a Triton kernel, one leaf at a
time: kernels that produce partials in order (K segments, gathered rank sums) add them as they
come, in the tree's order, holding one pending subtree sum per level."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tree_push(v, n: tl.constexpr, level0, level1, level2):
    """Leaf ``n`` (value v) of a balanced tree of up to 8 leaves (a power of two), added in
    ``samebits.ops.backend.tree_sum``'s order by a binary counter: v is added, right of them, to
    the completed subtrees the trailing one bits of n name (pairs, then pairs of pairs), and the
    result is kept at the level of n's lowest zero bit. Returns (the subtree sum that ends at
    leaf n -- the whole tree's after the last leaf --, level0, level1, level2)."""
    tl.static_assert(n < 8, "tree_push holds three levels: trees of up to 8 leaves")
    if n % 2 == 0:
        level0 = v
    else:
        v = level0 + v
        if n % 4 == 1:
            level1 = v
        else:
            v = level1 + v
            if n % 8 == 3:
                level2 = v
            else:
                v = level2 + v
    return v, level0, level1, level2
