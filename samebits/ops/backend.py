"""The op-backend interface and the registry that picks one implementation per (device, mode).

A backend is a set of small tensor-in, tensor-out functions. Models call them through the backend
object they were built with; the choice is made once, in ``get_backend``, never by ``if``s in model
code.

Invariant backends guarantee, for every op: the bits of an output row depend only on that row's own
inputs and on fixed constants (shapes of the weights, this module's tile and split sizes) -- never on
how many rows there are, where the row sits, or what the other rows hold. For attention, the output
of the query at position p depends only on q, and on K/V at positions [0, p] of its own sequence --
not on how many queries of the sequence run this step (prefill, chunk or decode), on the batch, or
on which physical KV blocks hold them.

Segmented K (the row-parallel linears, o_proj and down_proj; ``samebits.models.parallel``): with
``k_bounds`` = ((0, k1), (k1, k2), ..., (k_{S-1}, K)), ``linear`` computes one partial product per
K segment, each accumulated from zero in the backend's accumulation dtype (fp32; fp64 for fp64
inputs) exactly as ``linear`` would compute the product of that segment's columns alone, adds the
partials in the fixed balanced tree order of ``tree_sum``, casts once to x's dtype and then adds
the bias. ``linear_partials`` returns those partials unsummed, ``linear_sum`` their tree sum
uncast. A decoder's row-parallel segments are its KV-head segments run as the backend's K chains
(``row_parallel_chains``, ``chain_bounds``). A tensor-parallel rank computes its own chains'
partials; where the ranks' blocks of C/N chains are subtrees of that tree
(``rank_blocks_are_subtrees``: N a power of two dividing C, among others) each rank sums its own
block (``linear_sum``) and the N block sums are tree-summed and cast (``sum_tree``), else every
partial is gathered and ``sum_tree``'d: either way one device and N ranks give the same bits.
Invariant backends must honour ``k_bounds``; the standard backends ignore it in ``linear`` (stock
``F.linear``: the negative control, not TP-invariant).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from samebits.ops.encoder import SeqLayout
from samebits.ops.pending_merge import PendingMerge

KBounds = tuple[tuple[int, int], ...]  # ordered, contiguous [lo, hi) ranges covering [0, K)


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each sequence's queries and KV live, for one forward over a flattened batch.

    Sequence b owns queries ``query_start_loc[b]:query_start_loc[b+1]`` of the flat batch; its
    context (cached tokens plus this step's) has ``seq_lens[b]`` tokens, so its i-th query sits at
    position ``seq_lens[b] - query_len_b + i`` and attends to positions [0, that position].
    ``block_tables[b, j]`` is the physical block holding positions [j*block_size, (j+1)*block_size).
    The ``*_list`` twins are the same numbers as Python ints, for host-side loops.
    """

    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each new token
    seq_lens_list: tuple[int, ...]
    query_start_loc_list: tuple[int, ...]
    block_size: int
    split_size: int  # KV tokens per attention split
    plan: object | None = None  # backend-specific index tensors, built once per forward

    @property
    def query_lens(self) -> list[int]:
        qsl = self.query_start_loc_list
        return [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)


class NothingDeferred:
    """``attention_deferred`` for a backend that never defers: its own ``attention`` (a
    subclass's override included)."""

    def attention_deferred(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self.attention(q, k_cache, v_cache, meta, scale)


class OpBackend(Protocol):
    """What a model needs from the numerics. ``x`` rows are tokens; all reductions over the last dim."""

    name: str
    batch_invariant: bool
    # whether ``rms_norm(x, w, eps, residual)`` takes a row-parallel layer's ``PendingRankSum`` as
    # x (the ranks' gathered sums, added in the norm's kernel); else the layer resolves it first
    sums_in_norm: bool
    # on one device, up to this many rows a row-parallel layer of several K chains whose output
    # only feeds the norm hands it the chain partials (a ``PendingRankSum``, where
    # ``sums_in_norm``) instead of their sum: the linear's bits, one launch fewer where the
    # linear would write the partials to memory anyway. 0: never
    partials_into_norm_rows: int

    def row_parallel_chains(self, segments: int, world_size: int) -> int:
        """How many K chains a decoder's row-parallel linears (o_proj, down_proj) run over their
        S = ``segments`` segments at tensor-parallel size N = ``world_size``: C, a divisor of S
        that N divides (``chain_bounds``). Every N dividing C gives the same bits."""
        ...

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
               k_bounds: KBounds | None = None) -> torch.Tensor:
        """x [..., K] @ w[N, K].T (+ b) -> [..., N], accumulated in fp32; over the K segments
        ``k_bounds`` when given (module docstring)."""
        ...

    def linear_partials(self, x: torch.Tensor | PendingMerge, w: torch.Tensor,
                        k_bounds: KBounds) -> torch.Tensor:
        """The partial product of each K segment, [S, ..., N] in the accumulation dtype: what
        ``linear(x, w, k_bounds=k_bounds)`` adds in ``tree_sum``'s order. x may be this
        backend's ``attention_deferred`` output (merged here, or resolved first)."""
        ...

    def linear_sum(self, x: torch.Tensor, w: torch.Tensor, k_bounds: KBounds,
                   out: torch.Tensor | None = None, peer_out: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """[..., N] in the accumulation dtype: the bits of ``tree_sum(linear_partials(x, w,
        k_bounds))``, uncast (a tensor-parallel rank's sum of its own segments). ``out``: a
        contiguous tensor of that shape and dtype on x's device that receives those bits and is
        returned (``check_sum_outs``): a rank's slot of a buffer its peers read. ``peer_out``:
        another such tensor that receives the same bits (a peer's slot, mapped here)."""
        ...

    def sum_tree(self, partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[S, ..., N] -> [..., N] in ``dtype``: the bits of ``tree_sum(partials).to(dtype)``
        (the module-level ``sum_tree``); no bias."""
        ...

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, k_bounds: KBounds | None = None
                 ) -> torch.Tensor:
        """SiLU(gate) * up (the MLP's activation, [T, I]). With ``k_bounds`` (down_proj's K
        chains) an invariant backend gives each element the bits a tensor-parallel rank holding
        only that chain's columns computes: on CPU torch's elementwise kernels round an element
        differently in the vector body and in the scalar tail of a row, so the CPU backend runs
        one call per chain."""
        ...

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm over the last dim, computed in fp32, then cast back and scaled by w (HF order).

        With ``residual`` (the decoder's residual stream): ``(rms_norm(x + residual), x +
        residual)``, the sum rounded to x's dtype first -- the bits of a separate add, then the
        norm (``norm_with_residual``); a backend may do both in one pass."""
        ...

    def qkv_rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       hq: int, hkv: int, d: int) -> torch.Tensor:
        """The attention prologue: qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D] contiguous, with q and k
        RMSNormed per head (when ``q_norm``/``k_norm`` are given) and rotated (cos/sin [T, D] in
        qkv's dtype), k and v written to their ``slot_mapping`` slots of the caches. Bits: those of
        ``samebits.ops.rope.qkv_rope_store`` over this backend's ``rms_norm``."""
        ...

    def softmax(self, x: torch.Tensor) -> torch.Tensor: ...

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor: ...

    def plan_attention(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Build the backend's index tensors once per forward (shared by every layer)."""
        ...

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of q [T, Hq, D] over the paged cache [num_blocks, block_size, Hkv, D]."""
        ...

    def attention_deferred(self, q: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
                           ) -> torch.Tensor | PendingMerge:
        """``attention`` of one token, or its split partials not yet merged (a ``PendingMerge``,
        which this backend's ``linear_partials`` takes as x): the same bits either way."""
        ...

    # ---- encoder ops (BERT-style embedding models, samebits.ops.encoder) ------------------
    # Invariant backends: a token row's bits depend only on its own sequence's rows, a pooled
    # vector's only on its sequence's hidden states; sequences are packed back to back and
    # padding never enters a reduction. Standard backends run them as sentence-transformers
    # does: stock ops over a batch padded to its longest sequence.

    def plan_encoder(self, lens: list[int], device: torch.device) -> SeqLayout:
        """The flat-batch layout of sequences of these lengths (packed, or padded by the standard
        backends), with the index tensors ``encoder_attention`` reads."""
        ...

    def encoder_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          layout: SeqLayout, scale: float) -> torch.Tensor:
        """Bidirectional attention of q, k, v [T, H, D] within each sequence: every query reads
        all of its own sequence's keys and no other's -> [T, H, D] (padding rows: zeros)."""
        ...

    def layer_norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float
                   ) -> torch.Tensor:
        """LayerNorm over the last dim (torch's formula) with weight and bias."""
        ...

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        """GELU (erf), elementwise: torch's."""
        ...

    def pool(self, x: torch.Tensor, layout: SeqLayout, mode: str) -> torch.Tensor:
        """[T, H] -> [B, H]: each sequence's mean (a fixed tree, invariant backends), first
        (``cls``) or last (``lasttoken``) row."""
        ...

    def l2_normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Each row of [B, H] divided by its L2 norm (eps 1e-12, as ``F.normalize``)."""
        ...


class GraphableBackend(OpBackend, Protocol):
    """A backend whose decode step can be captured in a CUDA graph and replayed, and whose
    forward can be captured piecewise around its attention (``engine.piecewise_graph``): the
    attention prologue and the attention write into buffers the caller owns."""

    def qkv_rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       hq: int, hkv: int, d: int, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """``OpBackend.qkv_rope_store``, q written into ``out`` [T, Hq, D] (contiguous) when
        given, with the same bits."""
        ...

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """``OpBackend.attention``, written into ``out`` [T, Hq, D] (contiguous) when given, with
        the same bits."""
        ...

    def plan_decode(self, meta: AttentionMetadata, positions: torch.Tensor, max_len: int
                    ) -> AttentionMetadata:
        """The plan of a pure-decode batch (sequence i's one query at ``positions[i]``, none past
        ``max_len`` keys) built over tensors the caller owns and refills between replays: no
        host-side value of the batch is baked into the launches."""
        ...

    def as_captured(self) -> AbstractContextManager[None]:
        """Ops inside launch the kernel variants of the engine's graphs; the engine warms up and
        captures under it, so the warm-up compiles and loads every kernel the capture launches
        and none is compiled while capturing."""
        ...


def bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous near-equal [lo, hi) slices of range(total) (torch.tensor_split's:
    the first ``total % parts`` slices one longer)."""
    edges = [0]
    for i in range(parts):
        edges.append(edges[-1] + total // parts + (1 if i < total % parts else 0))
    return list(zip(edges[:-1], edges[1:], strict=True))


def row_parallel_bounds(k: int, num_segments: int) -> KBounds:
    """The K segments of a row-parallel weight with ``k`` input columns: ``bounds(k, S)``, S the
    model's KV heads. For o_proj (k = Hq D, a multiple of S) segment g is KV group g's columns."""
    return tuple(bounds(k, num_segments))


def every_segment(segments: int, world_size: int) -> int:
    """C = S: every KV-head segment its own chain (where a chain restarts at no cost: the CPU
    kernel's); every N dividing S gives the same bits."""
    return segments


def paired_chains(segments: int, world_size: int) -> int:
    """C = 2 for one device and two ranks where S is even (one device holds two chains at nearly
    one chain's cost, a rank one: the same bits), else C = N (one chain a rank)."""
    return 2 if world_size <= 2 and segments % 2 == 0 else world_size


def one_chain_per_rank(segments: int, world_size: int) -> int:
    """C = N: each rank one stock product (the standard mode; its bits depend on N)."""
    return world_size


@functools.lru_cache(maxsize=256)
def chain_bounds(k: int, segments: int, chains: int) -> KBounds:
    """The K bounds of ``chains`` chains over ``row_parallel_bounds(k, segments)``: chain j is
    segments [j S/C, (j + 1) S/C) merged (a rank owning whole segments owns whole chains)."""
    if chains < 1 or segments % chains:
        raise ValueError(f"{chains} K chains do not divide the {segments} KV-head segments")
    cuts, per = bounds(k, segments), segments // chains
    return tuple((cuts[j * per][0], cuts[(j + 1) * per - 1][1]) for j in range(chains))


def one_device_bounds(ops: OpBackend, k: int, segments: int) -> KBounds | None:
    """The K bounds ``ops`` runs a one-device row-parallel weight of ``k`` columns over (S =
    ``segments``: the model's KV heads); None: one chain."""
    chains = ops.row_parallel_chains(segments, 1)
    return chain_bounds(k, segments, chains) if chains > 1 else None


def check_k_bounds(k_bounds: KBounds, k: int) -> None:
    """Raise unless ``k_bounds`` are non-empty ordered ranges that tile [0, k) exactly."""
    edges = [lo for lo, _ in k_bounds]
    if (not k_bounds or edges[0] != 0 or k_bounds[-1][1] != k
            or any(hi != nxt for (_, hi), nxt in zip(k_bounds[:-1], edges[1:], strict=True))
            or any(hi <= lo for lo, hi in k_bounds)):
        raise ValueError(f"k_bounds {k_bounds} do not tile [0, {k})")


def check_sum_outs(x: torch.Tensor, n: int, dtype: torch.dtype, out: torch.Tensor | None,
                   peer_out: torch.Tensor | None) -> None:
    """Raise, naming the argument and what differs, unless each of ``out`` and ``peer_out``
    that is given can receive ``linear_sum(x, w)``'s [..., n] ``dtype`` result as it is
    written: that shape and dtype, on x's device, contiguous."""
    shape = (*x.shape[:-1], n)
    for name, t in (("out", out), ("peer_out", peer_out)):
        if t is None:
            continue
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != x.device:
            raise ValueError(f"linear_sum: {name} is {tuple(t.shape)} {t.dtype} on "
                             f"{t.device}; expected {shape} {dtype} on {x.device}")
        if not t.is_contiguous():
            raise ValueError(f"linear_sum: {name} must be contiguous (strides {t.stride()})")


def into_sum_outs(total: torch.Tensor, out: torch.Tensor | None,
                  peer_out: torch.Tensor | None) -> torch.Tensor:
    """A backend's ``linear_sum`` result ``total`` copied into ``peer_out`` and ``out`` where
    given (``check_sum_outs``); ``out`` where given, else ``total``."""
    if peer_out is not None:
        peer_out.copy_(total)
    return total if out is None else out.copy_(total)


def tree_sum(partials: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """The sum over the leading index in the fixed balanced tree order, in the partials' dtype:
    ``tree(p[0..n))`` is p0 for n == 1, else ``tree(p[0..h)) + tree(p[h..n))`` with h = (n + 1)
    // 2 (the left half the larger). n <= 3: the chain ``(p0 + p1) + p2``; n a power of two: the
    pairs (0, 1), (2, 3) ..., then pairs of pairs, computed level by level (log2 n adds of
    strided halves, the same additions). n == 1 returns ``partials[0]`` itself (a view)."""
    n = len(partials)
    if n == 0:
        raise ValueError("tree_sum of no partials")
    if isinstance(partials, torch.Tensor) and n & (n - 1) == 0:
        return _tree_by_levels(partials)
    return _tree_by_halves(partials, 0, n)


def sum_tree(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tree_sum(partials)`` cast once to ``dtype``: ``OpBackend.sum_tree`` in torch."""
    return tree_sum(partials).to(dtype)


def _tree_by_levels(partials: torch.Tensor) -> torch.Tensor:
    """The tree of a power-of-two count: each level adds the even entries to the odd ones."""
    while len(partials) > 1:
        partials = partials[0::2] + partials[1::2]
    return partials[0]


def _tree_by_halves(partials: torch.Tensor | list[torch.Tensor], lo: int, hi: int
                    ) -> torch.Tensor:
    """The tree of partials[lo:hi], recursively (any count)."""
    if hi - lo == 1:
        return partials[lo]
    h = lo + (hi - lo + 1) // 2
    return _tree_by_halves(partials, lo, h) + _tree_by_halves(partials, h, hi)


def rank_blocks_are_subtrees(segments: int, world_size: int) -> bool:
    """Whether ``tree_sum`` over ``segments`` partials equals ``tree_sum`` of the sums of its
    ``world_size`` contiguous blocks of S/N (each block tree-summed alone): every split of the
    tree down to the blocks falls on a block boundary, where the tree of the N block sums splits
    too. True when N is a power of two dividing S (and for N == S); false e.g. for S = 6, N = 3."""
    if world_size < 1 or segments % world_size:
        return False
    block = segments // world_size

    def aligned(blocks: int) -> bool:  # the tree over `blocks` blocks of `block` segments
        if blocks == 1:
            return True
        h = (blocks + 1) // 2
        return ((blocks * block + 1) // 2 == h * block and aligned(h) and aligned(blocks - h))

    return aligned(world_size)


def norm_with_residual(rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
                       x: torch.Tensor, w: torch.Tensor, eps: float,
                       residual: torch.Tensor | None
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(x, w, eps)``; with a residual, the separate add then the norm:
    ``(rms_norm(x + residual), x + residual)``."""
    if residual is None:
        return rms_norm(x, w, eps)
    summed = x + residual
    return rms_norm(summed, w, eps), summed


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write this step's K/V [T, Hkv, D] into their slots; attention then reads only the cache."""
    num_blocks, block_size, hkv, d = k_cache.shape
    k_cache.view(num_blocks * block_size, hkv, d).index_copy_(0, slot_mapping, k)
    v_cache.view(num_blocks * block_size, hkv, d).index_copy_(0, slot_mapping, v)


_REGISTRY: dict[tuple[str, bool], Callable[[], OpBackend]] = {}


def register(device_type: str, batch_invariant: bool):
    """Class decorator: the backend for ``device_type`` in the given mode."""
    def wrap(factory: Callable[[], OpBackend]) -> Callable[[], OpBackend]:
        _REGISTRY[(device_type, batch_invariant)] = factory
        return factory
    return wrap


def get_backend(device: torch.device | str, batch_invariant: bool) -> OpBackend:
    """The one place a backend is chosen. Backends hold no state, so one instance per (device
    type, mode) serves every caller; the choice is remembered per device as given (one lookup
    per eager op)."""
    backend = _CHOSEN.get((device, batch_invariant))
    if backend is None:
        device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
        backend = _CHOSEN[(device, batch_invariant)] = _instance(device_type, batch_invariant)
    return backend


def _instance(device_type: str, batch_invariant: bool) -> OpBackend:
    key = (device_type, batch_invariant)
    backend = _INSTANCES.get(key)
    if backend is None:
        _load_builtin_backends(device_type)
        if key not in _REGISTRY:
            mode = "batch-invariant" if batch_invariant else "standard"
            raise ValueError(f"no {mode} op backend for device {device_type!r}")
        backend = _INSTANCES[key] = _REGISTRY[key]()
    return backend


_INSTANCES: dict[tuple[str, bool], OpBackend] = {}
_CHOSEN: dict[tuple[torch.device | str, bool], OpBackend] = {}


# the modules that register the built-in backends (``register``), imported on first use of a
# device type: the interface does not depend on its implementations (they depend on it)
_BUILTIN_BACKENDS = {"cpu": ("samebits.ops.reference", "samebits.ops.standard"),
                     "cuda": ("samebits.ops.reference", "samebits.ops.standard",
                              "samebits.ops.standard_cuda", "samebits.ops.triton.backend")}


def _load_builtin_backends(device_type: str) -> None:
    for module in _BUILTIN_BACKENDS.get(device_type, ()):
        importlib.import_module(module)
