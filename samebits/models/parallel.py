"""Tensor-parallel layers whose bits do not depend on the number of ranks.

Every sharded dimension is cut into a fixed number of segments S (the model's KV heads), whatever
the tensor-parallel size N (which must divide S): ``bounds(size, S)`` near-equal slices, rank r
owning segments [r S/N, (r+1) S/N). One device is one rank owning all S segments.

- ``ColumnParallelLinear``: output rows split; each rank computes its own rows' outputs (a product's
  output column does not depend on the other columns). A fused layer (``QKVParallelLinear``; gate
  and up, two ``output_sizes``) splits each packed shard the same way, so a rank's q/k/v rows are
  its KV groups' and its gate/up rows the intermediate slices its down_proj columns multiply.
- ``RowParallelLinear``: input columns split; owns the K-chain arithmetic. Its S segments run as
  C chains (``OpBackend.row_parallel_chains``: C divides S, N divides C; chain j is segments
  [j S/C, (j+1) S/C) merged). A rank computes one fp32 partial product per owned chain; the C
  partials are added in ``tree_sum``'s balanced tree order, cast once, then the bias is added: on
  one device ``ops.linear(..., k_bounds)`` computes exactly this in one call
  (``samebits.ops.backend``). Where a rank's C/N chains form a subtree of that tree
  (``rank_blocks_are_subtrees``: N a power of two dividing C, among others), the rank tree-sums
  its own partials and the ranks gather one fp32 [..., H] sum each, tree-summed in rank order;
  otherwise every partial is gathered and tree-summed. So every N dividing C gives the same bits.
  The standard mode all-reduces one local product instead (its bits depend on N).
  A layer built ``into_norm`` (its output goes straight into the decoder's residual add +
  RMSNorm: o_proj, a decoder MLP's down_proj) hands that norm the gathered sums unsummed, a
  ``PendingRankSum``, where the backend sums them there (``sums_in_norm``) and there is no bias.
  The ranks' sums travel by NCCL's gather, or on CUDA (``SAMEBITS_TP_PUSH``; by default at two
  ranks) through symmetric memory: each rank's GEMM writes its sum into its own slot and the
  peer's at once (level 2, two ranks: ``push_peer_slot``), or into its own slot, then copied to
  its peers' (level 1: ``TPGroup.push_slot`` / ``push``): the same values in the same slots.
- ``VocabParallelEmbedding`` / ``ParallelLMHead``: vocab rows split; looked-up rows and logits
  are gathered in rank order, never summed.
- ``expert_param``: a mixture of experts' stacked matrices, split by expert (expert parallel
  inside the tensor-parallel group, ``ExpertSpec``): a rank holds whole experts, so an expert's
  output has one device's bits at every N; the outputs are gathered, never summed.

Loading (nano-vLLM's pattern): every parameter has ``weight_loader(param, loaded, shard)``, which
reads only this rank's rows or columns of the checkpoint tensor ``loaded`` (a tensor, or a
safetensors slice: only the shard is read) into shard ``shard`` of the parameter; its ``spec``
(``ShardSpec``) tells ``samebits.models.weights`` the full shape behind each shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from samebits.distributed.group import TPGroup
from samebits.ops.backend import (
    KBounds,
    OpBackend,
    chain_bounds,
    rank_blocks_are_subtrees,
)
from samebits.ops.pending_merge import PendingMerge
from samebits.ops.pending_rank_sum import PendingRankSum


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter's checkpoint tensors are split over the ranks: along ``dim``, each packed
    shard i of full size ``full_sizes[i]`` cut into ``segments`` near-equal slices, rank r owning
    the contiguous slices [r S/N, (r+1) S/N). ``dim`` None: replicated (every rank the whole)."""

    dim: int | None
    full_sizes: tuple[int, ...]
    segments: int
    rank: int
    world_size: int

    def span(self, shard: int, rank: int | None = None) -> tuple[int, int]:
        """[lo, hi) of rank ``rank`` (this rank by default) in shard ``shard``, along ``dim``."""
        if self.dim is None:
            return 0, self.full_sizes[shard]
        r = self.rank if rank is None else rank
        return chain_bounds(self.full_sizes[shard], self.segments, self.world_size)[r]

    def sizes(self, shard: int) -> list[int]:
        """Every rank's length of shard ``shard`` along ``dim``, in rank order."""
        return [hi - lo for lo, hi in (self.span(shard, r) for r in range(self.world_size))]

    def local_chains(self, chains: int, shard: int = 0) -> KBounds:
        """This rank's K chains of shard ``shard`` (``chain_bounds``: ``chains`` chains over the
        segments, rank r owning chains [r C/N, (r+1) C/N)), re-based to its own columns."""
        per = chains // self.world_size
        mine = chain_bounds(self.full_sizes[shard], self.segments, chains)[
            self.rank * per:(self.rank + 1) * per]
        lo = mine[0][0]
        return tuple((a - lo, b - lo) for a, b in mine)


@dataclass(frozen=True)
class ExpertSpec(ShardSpec):
    """Expert parallel: ``segments`` experts, each owning ``len(full_sizes) / segments``
    consecutive shards; rank r holds experts [r E/N, (r+1) E/N) whole and no rows of the others
    (their spans are empty)."""

    def span(self, shard: int, rank: int | None = None) -> tuple[int, int]:
        r = self.rank if rank is None else rank
        expert = shard // (len(self.full_sizes) // self.segments)
        owner = expert // (self.segments // self.world_size)
        return (0, self.full_sizes[shard]) if owner == r else (0, 0)


def expert_param(experts: int, shards: list[int], cols: int, group: TPGroup) -> nn.Parameter:
    """Experts' stacked matrices [E' sum(shards), cols]: each expert's ``shards`` (row counts;
    gate and up: two) in expert order, rank r holding its E' = E / N experts (``ExpertSpec``)."""
    if experts % group.world_size:
        raise ValueError(f"tensor_parallel_size={group.world_size} must divide the model's "
                         f"{experts} experts")
    spec = ExpertSpec(0, tuple(shards) * experts, experts, group.rank, group.world_size)
    return _param(spec, experts // group.world_size * sum(shards), cols)


def check_divides(group: TPGroup, segments: int) -> None:
    if segments % group.world_size:
        raise ValueError(f"tensor_parallel_size={group.world_size} must divide the model's "
                         f"{segments} KV heads")


def _param(spec: ShardSpec, *shape: int) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.spec = spec
    if len(spec.full_sizes) > 1:  # a fused parameter: its shards are row blocks
        p.shard_sizes = [hi - lo for lo, hi in (spec.span(i) for i in range(len(spec.full_sizes)))]
    p.weight_loader = sharded_weight_loader
    return p


def replicated_param(*shape: int) -> nn.Parameter:
    """A parameter every rank holds whole (norms, a bias added after the row-parallel sum)."""
    return _param(ShardSpec(None, (shape[0],), 1, 0, 1), *shape)


def sharded_weight_loader(param: nn.Parameter, loaded: Any, shard: int | None = None) -> None:
    """Copy this rank's part of checkpoint tensor ``loaded`` (shard ``shard`` of a fused
    parameter) into the parameter, converting to its dtype."""
    spec, i = param.spec, shard or 0
    dest = param.data
    if shard is not None:
        start = sum(param.shard_sizes[:shard])
        dest = dest.narrow(0, start, param.shard_sizes[shard])
    lo, hi = spec.span(i)
    if hi == lo:  # another rank's expert: nothing of it is read
        return
    index = (slice(None),) * (spec.dim or 0) + (slice(lo, hi),)
    dest.copy_(loaded[index])  # a safetensors slice reads only these rows / columns


class ColumnParallelLinear(nn.Module):
    """x [..., K] -> this rank's output columns [..., sum of its rows]. ``output_sizes``: the
    full rows of each packed shard (one entry: not fused)."""

    def __init__(self, input_size: int, output_sizes: list[int], segments: int, group: TPGroup,
                 bias: bool = False) -> None:
        super().__init__()
        check_divides(group, segments)
        self.group = group
        spec = ShardSpec(0, tuple(output_sizes), segments, group.rank, group.world_size)
        rows = sum(hi - lo for lo, hi in (spec.span(i) for i in range(len(output_sizes))))
        self.weight = _param(spec, rows, input_size)
        self.bias = _param(spec, rows) if bias else None

    def forward(self, ops: OpBackend, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """[q; k; v] fused; a rank's rows are its KV groups' q heads, k heads and v heads."""

    def __init__(self, hidden: int, head_dim: int, hq: int, hkv: int, group: TPGroup,
                 bias: bool = False) -> None:
        super().__init__(hidden, [hq * head_dim, hkv * head_dim, hkv * head_dim], hkv, group,
                         bias)
        self.hq, self.hkv = hq // group.world_size, hkv // group.world_size  # this rank's


class RowParallelLinear(nn.Module):
    """x [..., this rank's K columns] -> [..., N], summed over every rank's K chains: ``chains``
    C (``OpBackend.row_parallel_chains``) over the ``segments`` S, N dividing C dividing S.
    ``into_norm``: the output is only ever the x of ``ops.rms_norm(x, w, eps, residual)``, which
    may then be handed a ``PendingRankSum`` (``gathered``; on one device, up to the backend's
    ``partials_into_norm_rows`` rows, its chain partials)."""

    def __init__(self, input_size: int, output_size: int, segments: int, group: TPGroup,
                 chains: int, bias: bool = False, into_norm: bool = False) -> None:
        super().__init__()
        check_divides(group, segments)
        if segments % chains or chains % group.world_size:
            raise ValueError(f"{chains} K chains: must divide the {segments} KV heads and be "
                             f"divided by tensor_parallel_size={group.world_size}")
        self.group, self.into_norm = group, into_norm
        spec = ShardSpec(1, (input_size,), segments, group.rank, group.world_size)
        lo, hi = spec.span(0)
        self.weight = _param(spec, output_size, hi - lo)
        self.bias = replicated_param(output_size) if bias else None
        # this rank's K chains, in its own columns; None: one K chain (a negative control)
        self.k_bounds: KBounds | None = spec.local_chains(chains)
        # this rank's chains are a subtree of the C-partial tree: it gathers one sum, not C/N
        self.local_subtree = rank_blocks_are_subtrees(chains, group.world_size)
        # the group's ring this layer pushes its sum through (``TPGroup.reserve_push``)
        self.ring = (group.reserve_push(output_size)
                     if self.local_subtree and group.world_size > 1 else 0)

    def chains(self, ops: OpBackend) -> KBounds | None:
        """The K chains in force: on one device those the layer was built with (None for one;
        fixed at build from the building backend's ``row_parallel_chains``: run it with that
        backend's ops, or ops wrapping them); under tensor parallel the invariant mode runs
        them (the standard mode never)."""
        one_chain = self.k_bounds is None or (self.group.world_size == 1
                                              and len(self.k_bounds) == 1)
        if one_chain or (self.group.world_size > 1 and not ops.batch_invariant):
            return None
        return self.k_bounds

    def forward(self, ops: OpBackend, x: torch.Tensor | PendingMerge
                ) -> torch.Tensor | PendingRankSum:
        """x: [..., K], or an attention output still to merge (``PendingMerge``: the backend's
        ``linear_partials`` takes it, anything else resolves it first)."""
        if self.group.world_size == 1:
            return self._one_device(ops, x)
        if isinstance(x, PendingMerge):
            x = x.resolve()
        if not ops.batch_invariant:
            out = self.group.all_reduce_sum(ops.linear(x, self.weight))
            return out if self.bias is None else out + self.bias
        return self.gathered(ops, x)

    def _one_device(self, ops: OpBackend, x: torch.Tensor | PendingMerge
                    ) -> torch.Tensor | PendingRankSum:
        """The chains' partials left to the next norm where it sums them (a PendingMerge x
        handed to ``linear_partials`` as it is), else the product."""
        chains = self.chains(ops)
        if (chains is not None and self._norm_sums(ops)
                and x.shape[:-1].numel() <= ops.partials_into_norm_rows):
            return PendingRankSum(ops.linear_partials(x, self.weight, chains), x.dtype)
        if isinstance(x, PendingMerge):
            x = x.resolve()
        return ops.linear(x, self.weight, self.bias, k_bounds=chains)

    def gathered(self, ops: OpBackend, x: torch.Tensor) -> torch.Tensor | PendingRankSum:
        """The C chain partials tree-summed, cast, then the bias: the bits of
        ``ops.linear(x_full, w_full, b, k_bounds)`` on one device. Where this rank's chains
        are a subtree, it sums them itself (``linear_sum``) and the ranks gather one fp32 sum
        each; else every partial is gathered. ``sum_tree`` adds what was gathered and casts --
        or, ``into_norm`` without a bias on a backend that ``sums_in_norm``, the norm does:
        what was gathered is returned as a ``PendingRankSum``."""
        if self.local_subtree:
            every = self.rank_sums(ops, x)  # [N, ..., H]
        else:
            every = self.group.all_gather(ops.linear_partials(x, self.weight, self.k_bounds))
        if self._norm_sums(ops):
            return PendingRankSum(every, x.dtype)
        out = ops.sum_tree(every, x.dtype)  # every: [N or C, ..., H]
        return out if self.bias is None else out + self.bias

    def _norm_sums(self, ops: OpBackend) -> bool:
        """Whether the norm this layer feeds adds its sum's parts (``PendingRankSum``)."""
        return self.into_norm and self.bias is None and ops.sums_in_norm

    def rank_sums(self, ops: OpBackend, x: torch.Tensor) -> torch.Tensor:
        """[N, ..., H] fp32: every rank's ``linear_sum`` of its own chains, in rank order --
        written by the GEMM into this rank's slot (and, fused, the peer's) and pushed where the
        group takes the push (``push_slot``: the same choice on every rank), else gathered by
        NCCL. A pushed result is a view of the group's ring, valid only until this rank's next
        push barrier (``samebits.distributed.symmetric``, invariants): every reader of it (the
        next norm, ``sum_tree``, ``resolved``) must run before the next row-parallel layer
        pushes -- a caller that held o_proj's result while down_proj pushed would race -- and
        every kernel launched programmatically calls ``wait_for_inputs`` before it loads or
        stores activations, so the barrier's completion orders the GEMM's stores before it and
        the readers after it."""
        lead, h = x.shape[:-1], self.weight.shape[0]
        slot = self.group.push_slot(self.ring, lead.numel(), h)
        if slot is None:
            return self.group.all_gather(ops.linear_sum(x, self.weight, self.k_bounds)
                                         .unsqueeze(0))
        peer = self.group.push_peer_slot(self.ring, lead.numel(), h)
        ops.linear_sum(x, self.weight, self.k_bounds, out=slot.view(*lead, h),
                       peer_out=None if peer is None else peer.view(*lead, h))
        return self.group.push(self.ring, lead.numel(), h).view(-1, *lead, h)


class VocabParallelEmbedding(nn.Module):
    """Token ids -> rows of the embedding table; a rank holds its vocab segments' rows."""

    def __init__(self, vocab_size: int, hidden: int, segments: int, group: TPGroup) -> None:
        super().__init__()
        check_divides(group, segments)
        self.group = group
        spec = ShardSpec(0, (vocab_size,), segments, group.rank, group.world_size)
        self.vocab_start, self.vocab_end = spec.span(0)
        self.weight = _param(spec, self.vocab_end - self.vocab_start, hidden)
        ends = [spec.span(0, r)[1] for r in range(group.world_size)]
        self.register_buffer("rank_ends", torch.tensor(ends), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = F.embedding(torch.where(mine, input_ids - self.vocab_start, 0), self.weight)
        every = self.group.all_gather(local.unsqueeze(0))  # [N, T, H]
        owner = torch.searchsorted(self.rank_ends, input_ids, right=True)
        return every[owner, torch.arange(input_ids.shape[0], device=input_ids.device)]


class ParallelLMHead(nn.Module):
    """hidden [M, H] -> fp32 logits [M, V]: each rank scores its vocab rows, gathered in rank
    order. ``tied``: the embedding whose (identically split) table is the head."""

    def __init__(self, vocab_size: int, hidden: int, segments: int, group: TPGroup,
                 tied: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        check_divides(group, segments)
        self.group, self.tied = group, tied is not None
        self.spec = ShardSpec(0, (vocab_size,), segments, group.rank, group.world_size)
        rows = self.spec.sizes(0)[group.rank]
        self.weight = tied.weight if tied is not None else _param(self.spec, rows, hidden)

    def forward(self, ops: OpBackend, hidden: torch.Tensor) -> torch.Tensor:
        local = ops.linear(hidden, self.weight).float()
        return self.group.gather_cat(local, self.spec.sizes(0), dim=-1)


def full_bytes(model: nn.Module) -> int:
    """Bytes of the whole model's weights, whatever shard of them this rank holds (a sharded
    parameter counts at its full size along its split dim; replicated ones once)."""
    total = 0
    for p in model.parameters():
        spec: ShardSpec | None = getattr(p, "spec", None)
        numel = p.numel()
        if spec is not None and spec.dim is not None and p.shape[spec.dim]:
            numel = numel // p.shape[spec.dim] * sum(spec.full_sizes)
        total += numel * p.element_size()
    return total
