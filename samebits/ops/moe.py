"""Mixture-of-experts ops: routing, the experts and their combine, for any ``OpBackend``.

``select_experts(ops, logits, k, ...)`` -> (weights fp32 [T, k], ids int32 [T, k]) and
``fused_experts(ops, x, w13, w2, weights, ids, shared, scale)`` -> [T, H] in x's dtype, with
``w13`` [E, 2I, H] (each expert's gate rows, then its up rows) and ``w2`` [E, H, I]. Expert
parallel splits ``fused_experts`` in two: ``expert_outputs`` (y [T, k, H] of the experts this
rank holds) and, once every slot is gathered from its holder, ``combine_experts``.

Arithmetic of the invariant backends (a token's bits depend on its own row and the weights only):

- routing: softmax of the fp32 logits (the backend's row softmax on CPU; the route kernel's on
  CUDA, ``samebits.ops.triton.moe``); the k largest probabilities in descending order, ties to
  the lowest expert id; with ``renormalize`` each divided by their sum, added in rank order
  ``((p0 + p1) + p2) ...``; with ``round_weights`` rounded to the logits' dtype (transformers'
  Qwen routers).
- expert e on a token: ``y = down(silu(gate) * up)``, each product an invariant linear of one row
  (CPU: the C++ kernel's ascending-K fma chain per element, whatever the expert's token count;
  CUDA: the grouped Triton GEMM, fixed K order), rounded to x's dtype as a dense MLP rounds.
- combine, in fp32: ``acc = w_0 y_0; acc = acc + w_j y_j`` for j = 1 .. k-1 in rank order, then
  ``acc + scale * shared`` (Qwen2-MoE's shared expert; ``scale = sigmoid_gate(...)``), cast once.

The standard backends run stock PyTorch: ``torch.topk``, per-expert ``F.linear`` over the routed
tokens on CPU (``torch.nn.functional.grouped_mm`` on CUDA, the fastest stock path), a
``sum`` over k -- the negative control, whose bits follow the batch.

With ``DifferentiableOps`` (the trainer, the HF route) both ops keep the inner backend's forward
bits and take the backward of stock formulas of the same math -- ``_route_weights`` (torch's
softmax, the given ids) and ``_experts_loop`` (per-expert ``F.linear``, the ordered combine) --
deterministic: fixed shapes, and on CUDA PyTorch's deterministic index kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from samebits.ops import cpu_kernels
from samebits.ops.autograd import _Deterministic, invariant_apply
from samebits.ops.backend import OpBackend
from samebits.ops.tiles import silu_mul_rows


def select_experts(ops: OpBackend, logits: torch.Tensor, top_k: int, renormalize: bool,
                   round_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing weights fp32 [T, k], expert ids int32 [T, k]) of router ``logits`` [T, E]."""
    inner = getattr(ops, "inner", ops)  # DifferentiableOps wraps the engine's backend
    route = _route_impl(inner, logits.device)
    if inner is not ops and torch.is_grad_enabled() and logits.requires_grad:
        return _Routed.apply(partial(route, top_k=top_k, renormalize=renormalize,
                                     round_weights=round_weights),
                             partial(_route_weights, renormalize=renormalize,
                                     round_weights=round_weights), logits)
    with torch.no_grad():
        return route(logits, top_k=top_k, renormalize=renormalize, round_weights=round_weights)


def sigmoid_gate(ops: OpBackend, g: torch.Tensor) -> torch.Tensor:
    """sigmoid(g) in fp32 for g [T, 1], as the backend's row softmax of (g, 0): a row op, so
    invariant where the backend's softmax is (torch's CPU sigmoid rounds an element by where it
    sits in the tensor: vector body or scalar tail)."""
    z = g.float()
    return ops.softmax(torch.cat([z, torch.zeros_like(z)], dim=-1))[:, 0]


def fused_experts(ops: OpBackend, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor | None = None,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) (+ scale[t] * shared[t]) -> [T, H]."""
    inner = getattr(ops, "inner", ops)
    fwd = partial(_experts_impl(inner, x.device), ids=ids)
    if inner is not ops:
        ref = partial(_experts_loop, ids=ids)
        return invariant_apply(fwd, _Deterministic(ref) if x.is_cuda else ref, x, w13, w2,
                               weights, shared, scale)
    with torch.no_grad():
        return fwd(x, w13, w2, weights, shared, scale)


def expert_outputs(ops: OpBackend, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   ids: torch.Tensor, first: int, total: int) -> torch.Tensor:
    """y [T, k, H] in x's dtype, y[t, j] = expert_{ids[t, j]}(x[t]) for the experts this device
    holds: ``w13`` / ``w2`` hold experts [first, first + E') of the model's ``total`` (expert
    parallel); the slots of other experts are left unspecified. A held slot has the bits
    ``fused_experts`` combines."""
    inner = getattr(ops, "inner", ops)
    with torch.no_grad():
        if x.is_cuda and (inner.batch_invariant or not _grouped_mm_takes(x)):
            from samebits.ops.triton import moe as triton_moe
            flat = local_ids(ids, first, w13.shape[0]).to(torch.int32).contiguous()
            return triton_moe.expert_outputs(x, w13, w2, flat, ids.shape[1], total).view(
                *ids.shape, x.shape[-1])
        impl = outputs_grouped_mm if x.is_cuda else (
            expert_outputs_cpu if inner.batch_invariant else _outputs_loop)
        return impl(x, w13, w2, ids=ids, first=first)


def combine_experts(ops: OpBackend, y: torch.Tensor, weights: torch.Tensor,
                    shared: torch.Tensor | None, scale: torch.Tensor | None) -> torch.Tensor:
    """y [T, k, H] (every expert's outputs) -> [T, H]: ``fused_experts``' combine."""
    inner = getattr(ops, "inner", ops)
    with torch.no_grad():
        if not inner.batch_invariant:
            return combine_stock(y, weights, shared, scale, y.dtype)
        if y.is_cuda:
            from samebits.ops.triton import moe as triton_moe
            return triton_moe.combined(y.flatten(0, 1), weights, shared, scale)
        return combine_ordered(y, weights, shared, scale, y.dtype)


# ---- dispatch ------------------------------------------------------------------------------
def _route_impl(inner: OpBackend, device: torch.device) -> Callable:
    if not inner.batch_invariant:
        return _route_stock
    if device.type == "cuda":
        from samebits.ops.triton import moe as triton_moe
        return triton_moe.route
    return partial(_route, softmax=inner.softmax, topk=topk_lowest_id)


def _grouped_mm_takes(x: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM (the stock CUDA experts) takes x: bf16, where it exists."""
    return x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")


def _experts_impl(inner: OpBackend, device: torch.device) -> Callable:
    if inner.batch_invariant:
        if device.type == "cuda":
            from samebits.ops.triton import moe as triton_moe
            return triton_moe.fused_experts
        return experts_cpu
    if device.type == "cuda" and hasattr(F, "grouped_mm"):
        return experts_grouped_mm
    return partial(_experts_loop, combine=combine_stock)


# ---- routing -------------------------------------------------------------------------------
def topk_lowest_id(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of ``probs`` (fp32, >= 0) in descending order, ties to the
    lowest index: one top-k over unique int64 keys (the value's bits above the complement of
    the index), so no tie is left for the library's algorithm to break."""
    e = probs.shape[-1]
    lane = 0xFFFF - torch.arange(e, device=probs.device, dtype=torch.int64)
    keys = (probs.contiguous().view(torch.int32).to(torch.int64) << 16) | lane
    ids = 0xFFFF - (torch.topk(keys, k, dim=-1).values & 0xFFFF)
    return probs.gather(-1, ids), ids


def _route_stock(logits: torch.Tensor, top_k: int, renormalize: bool, round_weights: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' router: torch's softmax, ``torch.topk``, one ``sum`` over k."""
    vals, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        vals = vals / vals.sum(dim=-1, keepdim=True)
    return (vals.to(logits.dtype).float() if round_weights else vals), ids.to(torch.int32)


def _route(logits: torch.Tensor, top_k: int, renormalize: bool, round_weights: bool, *,
           softmax: Callable, topk: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    vals, ids = topk(softmax(logits.float()), top_k)
    return _normalized(vals, logits.dtype, renormalize, round_weights), ids.to(torch.int32)


def _normalized(vals: torch.Tensor, dtype: torch.dtype, renormalize: bool,
                round_weights: bool) -> torch.Tensor:
    """The top-k probabilities divided by their rank-order sum, rounded through ``dtype``."""
    if renormalize:
        total = vals[:, 0]
        for j in range(1, vals.shape[1]):
            total = total + vals[:, j]
        vals = vals / total[:, None]
    return vals.to(dtype).float() if round_weights else vals


def _route_weights(logits: torch.Tensor, ids: torch.Tensor, renormalize: bool,
                   round_weights: bool) -> torch.Tensor:
    """The routing weights of given ``ids`` by stock ops: the backward's formula."""
    vals = torch.softmax(logits.float(), dim=-1).gather(-1, ids.long())
    return _normalized(vals, logits.dtype, renormalize, round_weights)


class _Routed(torch.autograd.Function):
    """forward(route, ref, logits) = route(logits) -> (weights, ids); backward: the VJP of
    ``ref(logits, ids)`` (ids are not differentiable)."""

    @staticmethod
    def forward(ctx, route: Callable, ref: Callable, logits: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = route(logits.detach())
        ctx.ref = ref
        ctx.mark_non_differentiable(ids)
        ctx.save_for_backward(logits, ids)
        return weights, ids

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _ids_grad: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        logits, ids = ctx.saved_tensors
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(ctx.ref(leaf, ids), leaf, grad)
        return None, None, g


# ---- the experts ---------------------------------------------------------------------------
def combine_ordered(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
                    scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """y [T, k, H] -> [T, H]: the fp32 sum in rank order, then the shared term, cast once."""
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    w = weights.to(acc_dtype)
    acc = w[:, 0:1] * y[:, 0].to(acc_dtype)
    for j in range(1, y.shape[1]):
        acc = acc + w[:, j:j + 1] * y[:, j].to(acc_dtype)
    if shared is not None:
        acc = acc + scale.to(acc_dtype)[:, None] * shared.to(acc_dtype)
    return acc.to(dtype)


def combine_stock(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
                  scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """transformers' grouped combine: one ``sum`` over k in fp32 (the library's order)."""
    acc = (y.float() * weights[..., None]).sum(dim=1)
    if shared is not None:
        acc = acc + scale[:, None] * shared.float()
    return acc.to(dtype)


_PACKS = "_samebits_packed"  # cpu_kernels' attribute: ``forget_packed`` drops it on updates


def _expert_packs(w: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each expert's matrix of ``w`` [E, N, K] packed for the C++ linear, kept on the tensor
    that owns the storage (the model's parameter) while its address and version stay."""
    owner = w if w._base is None else w._base
    try:
        key = (w.data_ptr(), owner._version, dtype, tuple(w.shape), "experts")
    except RuntimeError:  # an inference tensor has no version counter: pack afresh
        key = None
    cached = getattr(owner, _PACKS, None)
    if key is not None and cached is not None and cached[0] == key:
        return cached[1]
    packs = [cpu_kernels.pack_weight(w[e].to(dtype)) for e in range(w.shape[0])]
    if key is not None:
        setattr(owner, _PACKS, (key, packs))
    return packs


def local_ids(ids: torch.Tensor, first: int, experts: int) -> torch.Tensor:
    """Each assignment's held expert, flat: ``ids - first``, and ``experts`` (E') for every
    expert outside [first, first + E') -- held by another rank."""
    flat = ids.reshape(-1) - first
    return torch.where((flat >= 0) & (flat < experts), flat, experts)


def expert_outputs_cpu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                       ids: torch.Tensor, first: int = 0) -> torch.Tensor:
    """The invariant CPU experts' y [T, k, H]: the held assignments grouped by expert, each group
    through the C++ linear (row-invariant for any row count), SiLU row by row; others zero."""
    (t, h), k, inter, experts = x.shape, ids.shape[1], w2.shape[2], w13.shape[0]
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    flat = local_ids(ids.long(), first, experts)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts + 1).tolist()
    order = order[:t * k - counts[experts]]  # the held assignments, by expert
    xs = x[order // k].to(cdt)
    out = torch.empty(order.numel(), h, dtype=x.dtype)
    packs13, packs2 = _expert_packs(w13, cdt), _expert_packs(w2, cdt)
    start = 0
    for e, n in enumerate(counts[:experts]):
        if n:
            rows = slice(start, start + n)
            gu = cpu_kernels.linear(xs[rows].contiguous(), packs13[e], 2 * inter).to(x.dtype)
            act = silu_mul_rows(gu[:, :inter], gu[:, inter:]).to(cdt).contiguous()
            out[rows] = cpu_kernels.linear(act, packs2[e], h).to(x.dtype)
            start += n
    y = (torch.zeros if counts[experts] else torch.empty)(t * k, h, dtype=x.dtype)
    y[order] = out
    return y.view(t, k, h)


def experts_cpu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                shared: torch.Tensor | None, scale: torch.Tensor | None, *, ids: torch.Tensor
                ) -> torch.Tensor:
    """The invariant CPU experts (``expert_outputs_cpu``) and the ordered combine."""
    return combine_ordered(expert_outputs_cpu(x, w13, w2, ids=ids), weights, shared, scale,
                           x.dtype)


def _outputs_loop(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *, ids: torch.Tensor,
                  first: int = 0) -> torch.Tensor:
    """Stock ops' y [T, k, H]: per held expert, ``F.linear`` over its routed tokens
    (transformers' eager loop); other slots zero."""
    (t, k), experts = ids.shape, w13.shape[0]
    rows, slots, outs = [], [], []
    for e in torch.unique(ids).tolist():
        if not first <= e < first + experts:
            continue
        tok, j = (ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[tok], w13[e - first]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, w2[e - first]))
        rows.append(tok)
        slots.append(j)
    y = x.new_zeros(t, k, x.shape[1])
    if outs:
        y = y.index_put((torch.cat(rows), torch.cat(slots)), torch.cat(outs))
    return y


def _experts_loop(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  shared: torch.Tensor | None, scale: torch.Tensor | None, *,
                  ids: torch.Tensor, combine: Callable = combine_ordered) -> torch.Tensor:
    """Stock ops (``_outputs_loop``) and a combine: the standard CPU path (stock combine) and
    the backward's formula (ordered combine)."""
    return combine(_outputs_loop(x, w13, w2, ids=ids), weights, shared, scale, x.dtype)


def experts_grouped_mm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       weights: torch.Tensor, shared: torch.Tensor | None,
                       scale: torch.Tensor | None, *, ids: torch.Tensor) -> torch.Tensor:
    """The stock CUDA path (transformers' default): ``outputs_grouped_mm`` and the stock
    combine. Other dtypes than bf16 (grouped_mm's) take the Triton experts and combine."""
    if not _grouped_mm_takes(x):
        from samebits.ops.triton import moe as triton_moe
        return triton_moe.fused_experts(x, w13, w2, weights, shared, scale, ids=ids)
    return combine_stock(outputs_grouped_mm(x, w13, w2, ids=ids), weights, shared, scale,
                         x.dtype)


def outputs_grouped_mm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                       ids: torch.Tensor, first: int = 0) -> torch.Tensor:
    """Stock CUDA y [T, k, H]: the held assignments sorted by expert (others last, outside
    every group: their rows unspecified), two ``F.grouped_mm`` over per-expert offsets, SiLU.
    No host sync. bf16 only (``_grouped_mm_takes``)."""
    (t, h), k, experts = x.shape, ids.shape[1], w13.shape[0]
    flat = local_ids(ids.long(), first, experts)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts[:experts], 0, dtype=torch.int32)
    gate, up = F.grouped_mm(x[order // k], w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    out = F.grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    y = torch.empty_like(out)
    y[order] = out
    return y.view(t, k, h)
