"""The batch-invariant linear's tile policy (``linear.py`` plans and launches with it): tile shapes
by row count, the K segment layouts of the row-parallel linears, and which tile a segmented
product takes. Nothing here changes a bit: on Hopper a tile's shape does not change an output
element's K order (docs/DESIGN.md section 2); it is free to follow speed.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from samebits.ops.backend import KBounds, check_k_bounds

SEGMENT_ALIGN = 256  # segment lengths are multiples of this (every BLOCK_K divides it)
SPLIT_MAX_M = 64  # above this many rows, segmented K takes the segmented TMA kernel
SEGMENTED_TMA_MAX = 16  # the most segments _segmented_tma_kernel sums (its stack: 4 entries)
MIN_BLOCK_K, MAX_STAGES = 32, 8  # the smallest BLOCK_K and most stages a segmented tile takes
# from FUSED_MIN_M + 1 to SPLIT_MAX_M rows, up to FUSED_MAX_SEGS even segments are tree-summed in
# registers; GEMVs keep the split schedule, whose S times more programs are faster there (H100,
# Qwen3-8B on one GPU, 2 segments: o_proj at M = 1 / 16 12.3 / 9.7 us split, 16.1 / 13.4 fused,
# one K chain 14.3 / 10.8; at M = 64 fused 12.2, split 12.0-16.8 by tile)
FUSED_MIN_M, FUSED_MAX_SEGS = 16, 8
SMEM_BYTES = 226 * 1024  # shared memory a Hopper program may take, less a margin for barriers
PREFETCH = 64 * 1024  # weight bytes a GEMV program prefetches while the previous kernel runs


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    tma: bool = False  # persistent TMA kernel (16-bit dtypes, 16-byte aligned rows)
    prefetch: int = 0  # bytes of its weight rows a program asks L2 for before its input is ready
    subtile: bool = False  # the segmented TMA kernel stores its output in two column halves

    def __post_init__(self) -> None:
        threads = self.num_warps * 32
        if self.prefetch and (threads % self.block_n or self.prefetch % (16 * threads)):
            raise ValueError(f"prefetch needs BLOCK_N | threads and 16 * threads | bytes: {self}")


@dataclasses.dataclass(frozen=True)
class SegmentLayout:
    """``count`` K segments: segment s starts at ``s * base + min(s, extra)`` and has ``base``
    columns, one more when s < extra; the last one is clipped to K."""

    count: int
    base: int
    extra: int = 0

    def __post_init__(self) -> None:
        if self.count < 1 or self.base < 1 or not 0 <= self.extra < self.count:
            raise ValueError(f"bad segment layout {self}")

    @classmethod
    def uniform(cls, k: int, segments: int) -> SegmentLayout:
        """``segments`` segments of a multiple of SEGMENT_ALIGN columns (fewer if K is short)."""
        seg_k = -(-k // (segments * SEGMENT_ALIGN)) * SEGMENT_ALIGN
        return cls(-(-k // seg_k), seg_k)

    @classmethod
    @functools.lru_cache(maxsize=256)
    def from_bounds(cls, k_bounds: KBounds, k: int) -> SegmentLayout:
        """The layout of near-equal ``k_bounds`` (lengths q+1 ... then q ...); else ValueError."""
        check_k_bounds(k_bounds, k)
        if not near_equal(k_bounds):
            raise ValueError(f"the Triton kernels take near-equal K segments, got {k_bounds}")
        lengths = [hi - lo for lo, hi in k_bounds]
        return cls(len(lengths), min(lengths), sum(1 for n in lengths if n > min(lengths)))

    def even(self, k: int, block_k: int) -> bool:
        """Every segment a whole number of BLOCK_K steps (the kernel's loads need no masks)."""
        return self.extra == 0 and self.base % block_k == 0 and k % block_k == 0


# the pointer kernel's tile for a segment's product above SPLIT_MAX_M rows (16-bit inputs) where
# the segmented TMA kernel does not take it (more than SEGMENTED_TMA_MAX segments)
SEGMENTED_TILE = GemmConfig(128, 128, 64, 8, 3)
SMALL_TMA_M = 128  # up to this many rows a segmented product takes SMALL_TMA_TILE
# a rank's one fp32 chain: up to ONE_CHAIN_TMA_MAX_M rows TWO_SEGMENT_TILES' first tile, above
# it ONE_CHAIN_TILES by rows, (max M, tile): the fastest of a sweep on Qwen3-8B's TP 2 o_proj
# and down_proj (H100, 256-8192 rows; 0.70-0.80x the pointer tile's time); the 128x256 tile's
# fp32 output fits shared memory beside its stages only in two halves (``_seg_tma_plan``)
ONE_CHAIN_TMA_MAX_M = 256
ONE_CHAIN_TILES = ((1024, GemmConfig(128, 128, 64, 8, 4, tma=True)),
                   (None, GemmConfig(128, 256, 64, 8, 3, tma=True)))
SMALL_TMA_TILE = GemmConfig(64, 64, 128, 4, 6, tma=True)
# two segments (one GPU's share of TP 2's chains) by rows, beyond SMALL_TMA_M: (max M, tile);
# each the fastest on Qwen3-8B's o_proj and down_proj (H100, benchmarks/segmented_linear.py):
# 1.02-1.19x one K chain's time at M <= 256, faster than it at 384-1024, 1.04-1.11x above
TWO_SEGMENT_TILES = ((256, GemmConfig(64, 128, 128, 4, 4, tma=True)),
                     (1024, GemmConfig(128, 128, 128, 8, 3, tma=True)),
                     (None, GemmConfig(128, 256, 64, 8, 3, group_m=16, tma=True)))
# _segmented_tma_kernel's tiles for 3-4, 5-8 and 9-16 segments (indexed by ceil(log2 S) - 2; the
# tree's pending subtree sums are held beside the accumulator, up to ceil(log2 S) of them; 8
# warps hold 64 registers per 128x128 fp32 tile): the
# fastest of a sweep at M = 2048 (H100, benchmarks/segmented_linear.py --sweep; Qwen3-8B's TP 2
# o_proj / down_proj for 4 segments, TP 1 o_proj for 8); 9-16 segments: compiled without
# spills, not timed.
SEGMENTED_TMA_TILES = (GemmConfig(128, 128, 128, 8, 3, tma=True),
                       GemmConfig(64, 128, 128, 4, 4, tma=True),
                       GemmConfig(64, 64, 64, 4, 4, tma=True))


@functools.lru_cache(maxsize=256)
def near_equal(k_bounds: KBounds) -> bool:
    """Whether the ranges' lengths run q + 1 ... then q ... (a ``SegmentLayout``)."""
    lengths = [hi - lo for lo, hi in k_bounds]
    base = min(lengths)
    extra = sum(1 for n in lengths if n > base)
    return lengths == [base + (s < extra) for s in range(len(lengths))]


def num_segments(k: int, n: int) -> int:
    """Ordered K segments: a function of the weight shape alone (never of M).

    One everywhere: on the H200 an ordered split-K never beat the best single-segment tile
    (benchmarks/NOTES-kernels.md). The machinery stays tested for shapes that may need it.
    """
    return 1


def segment_len(k: int, n: int) -> int:
    s = num_segments(k, n)
    return -(-k // (s * SEGMENT_ALIGN)) * SEGMENT_ALIGN


@functools.lru_cache(maxsize=4096)
def segmented_config(m: int, n: int, k: int, dtype: torch.dtype, layout: SegmentLayout
                     ) -> GemmConfig:
    """The tile of a segmented product (free to vary: it does not change the bits): above
    SPLIT_MAX_M rows (16-bit) ``segmented_tma_config``'s (the pointer kernel's SEGMENTED_TILE
    where the TMA kernel cannot run it), else the small-M schedules' -- with the largest BLOCK_K
    up to the tile's own that makes ``layout`` even: a segment that is not a whole number of
    BLOCK_K steps takes masked loads the compiler cannot vectorize (several times slower; e.g.
    Qwen3-32B's down_proj at TP 2, 3200 columns a segment)."""
    cfg = segmented_tma_config(layout.count, m) if m > SPLIT_MAX_M and dtype != torch.float32 \
        else pick_config(m, n, k, dtype)
    block_k = cfg.block_k
    while not layout.even(k, block_k) and block_k > MIN_BLOCK_K:
        block_k //= 2
    if block_k == cfg.block_k or not layout.even(k, block_k):
        return cfg
    stages = min(MAX_STAGES, cfg.num_stages * cfg.block_k // block_k)  # the same bytes in flight
    return dataclasses.replace(cfg, block_k=block_k, num_stages=stages)


def segmented_tma_config(segments: int, m: int) -> GemmConfig:
    """The tile of an M-row product over ``segments`` K segments above SPLIT_MAX_M rows (16-bit):
    ``_segmented_tma_kernel``'s by M and its stack depth (one segment -- an fp32 or peer-stored
    chain -- as two up to 256 rows, ONE_CHAIN_TILES above), or the pointer kernel's
    SEGMENTED_TILE (more segments than the kernel's stack takes)."""
    if not 1 <= segments <= SEGMENTED_TMA_MAX:
        return SEGMENTED_TILE
    if m <= SMALL_TMA_M:
        return SMALL_TMA_TILE
    if segments == 1 and m > ONE_CHAIN_TMA_MAX_M:
        return next(cfg for top, cfg in ONE_CHAIN_TILES if top is None or m <= top)
    if segments <= 2:
        return next(cfg for top, cfg in TWO_SEGMENT_TILES if top is None or m <= top)
    return SEGMENTED_TMA_TILES[(segments - 1).bit_length() - 2]


# a one-segment GEMV (up to 8 rows, N < 24576) through the persistent TMA kernel:
# in the decode step's CUDA graph, Qwen3-30B-A3B's qkv (K 2048, N 5120) 10.4-10.6 us against
# 11.2-12.4 for the pointer tile with its prefetch (H100, benchmarks/RESULTS.md)
GEMV_TMA_TILE = GemmConfig(16, 64, 256, 4, 4, tma=True)


@functools.lru_cache(maxsize=4096)
def pick_config(m: int, n: int, k: int, dtype: torch.dtype, plain_tma: bool = False
                ) -> GemmConfig:
    """Tile shape for an M-row product (free to vary: it does not change the bits).
    ``plain_tma``: the one-segment TMA kernel can take the product (one K segment, no partials
    kept, no peer output, operands TMA can read)."""
    if dtype == torch.float32:  # FMA path: small tiles, BLOCK_K divides SEGMENT_ALIGN
        return GemmConfig(32 if m <= 32 else 64, 64, 32, 4, 3)
    if m <= 16 and n <= 256:  # a router: 16 columns a program spread it over 8x the SMs
        return GemmConfig(16, 16, 512 if k % 512 == 0 else 256, 4, 4, prefetch=PREFETCH)
    if m <= 8:
        if n < 24576:
            return GEMV_TMA_TILE if plain_tma else GemmConfig(16, 64, 256, 4, 4,
                                                                prefetch=PREFETCH)
        return GemmConfig(16, 64, 128, 4, 5, prefetch=PREFETCH)
    if m <= 16:
        return GemmConfig(16, 64, 256, 4, 4, prefetch=PREFETCH)
    if m <= 32:
        return GemmConfig(32, 32, 256, 4, 4, prefetch=PREFETCH)
    if m <= 64:  # N <= 4096: 32-column tiles, else 64 tiles would leave half the SMs idle
        if n <= 4096:
            return GemmConfig(64, 32, 256, 4, 4, prefetch=PREFETCH)
        return GemmConfig(64, 64, 128, 4, 4, prefetch=PREFETCH)
    if m <= 128:  # tiles picked on H200 and H100 sweeps (benchmarks/NOTES-kernels.md)
        if n <= 4096:
            return GemmConfig(64, 64, 128, 4, 6, tma=True)
        return GemmConfig(64, 128, 128, 4, 4, tma=True)
    if m <= 1024 and n < 16384:
        return GemmConfig(64, 128, 128, 4, 4, tma=True)
    return GemmConfig(128, 256, 64, 8, 3, group_m=16, tma=True)


def smem_bytes(cfg: GemmConfig, x_dtype: torch.dtype, out_dtype: torch.dtype,
               outputs: int = 1) -> int:
    """Shared memory of a TMA tile: its stages of x and w blocks, and ``outputs`` output tiles
    (the TMA store's staging tile, half of it ``subtile``; a second output's pointer stores take
    as much again, the scratch of the accumulator's layout conversion)."""
    stage = (cfg.block_m + cfg.block_n) * cfg.block_k * x_dtype.itemsize
    staged = cfg.block_m * cfg.block_n // (2 if cfg.subtile else 1) * out_dtype.itemsize
    return cfg.num_stages * stage + outputs * staged


@functools.lru_cache(maxsize=64)
def uniform_layout(k: int, segments: int) -> SegmentLayout:
    return SegmentLayout.uniform(k, segments)
