"""transformers' sparse MoE blocks as the engine's, for ``samebits.batch_invariant()``
(``samebits.models.hf_route``).

Inside the block the ``forward`` of ``Qwen3MoeSparseMoeBlock``,
``Qwen2MoeSparseMoeBlock`` and ``MixtralSparseMoeBlock`` (where their modeling module is
imported) runs ``samebits.models.moe.SparseMoeBlock``'s arithmetic on the module's own weights
(``gate.weight``, ``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I], Qwen2's
``shared_expert`` and ``shared_expert_gate``) through ``DifferentiableOps`` of the invariant
backend: the engine's bits forward, stock formulas backward. Everything around the block
(attention, norms, dense MLPs, LM head) stays transformers' code under the aten overrides.

Why the block and not its aten ops: ``torch.topk`` leaves the order of equal probabilities to
the library (bf16 router probabilities tie often); the experts' ``act_fn(gate) * up`` runs over
all routed rows in one call, and torch's CPU SiLU rounds an element by where a multi-threaded
split lands in its row; the experts' products are ``grouped_mm`` (or a per-expert loop, by
``experts_implementation``); the ``sum`` over k of the router's ``norm_topk_prob`` and of the
grouped combine runs in torch's vectorized order once k > 8 (it is sequential up to 8 on the
CPUs tried); Qwen2's ``F.sigmoid`` gate rounds an element by its place in the tensor on CPU.
Routing the block gives each of these the engine's definition. Not routed (the stock forward
runs): a block whose experts are transposed or carry biases, Mixtral with router jitter while
training. The router module is not called, so ``output_router_logits`` records nothing for a
routed block.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from samebits.ops.autograd import DifferentiableOps
from samebits.ops.backend import get_backend, one_device_bounds
from samebits.ops.moe import fused_experts, select_experts, sigmoid_gate

_BLOCKS = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "qwen2_moe": "Qwen2MoeSparseMoeBlock",
           "mixtral": "MixtralSparseMoeBlock"}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _routable(module: torch.nn.Module, x: torch.Tensor) -> bool:
    experts = module.experts
    return (x.dtype in _FLOATS and x.numel() > 0 and experts.gate_up_proj.dtype == x.dtype
            and not getattr(experts, "is_transposed", False)
            and not getattr(experts, "has_bias", False)
            and not (module.training and getattr(module, "jitter_noise", 0) > 0))


def _shared(ops, module: torch.nn.Module, x: torch.Tensor, heads: int
            ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Qwen2-MoE's shared expert as the engine's ``MLP`` computes it (fused gate/up product,
    down_proj over its K segments), and its sigmoid gate."""
    mlp = getattr(module, "shared_expert", None)
    if mlp is None:
        return None, None
    gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
    gate, up = ops.linear(x, gate_up).chunk(2, dim=-1)
    bounds = one_device_bounds(ops, mlp.down_proj.weight.shape[1], heads)
    shared = ops.linear(ops.silu_mul(gate, up, bounds), mlp.down_proj.weight, k_bounds=bounds)
    return shared, sigmoid_gate(ops, ops.linear(x, module.shared_expert_gate.weight))


def engine_block(stock: Callable, busy: Callable[[], AbstractContextManager[None]],
                 module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """An HF sparse MoE block's forward with the engine's arithmetic (stock where it cannot)."""
    if not _routable(module, hidden_states):
        return stock(module, hidden_states)
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    router, experts = module.gate, module.experts
    ops = DifferentiableOps(get_backend(x.device, batch_invariant=True))
    renormalize = getattr(router, "norm_topk_prob", True)  # Mixtral always renormalizes
    round_weights = type(module).__name__ != "MixtralSparseMoeBlock"
    with busy():
        logits = ops.linear(x, router.weight)
        weights, ids = select_experts(ops, logits, router.top_k, renormalize, round_weights)
        shared, scale = _shared(ops, module, x, experts.config.num_key_value_heads)
        out = fused_experts(ops, x, experts.gate_up_proj, experts.down_proj, weights, ids,
                            shared, scale)
    return out.reshape(hidden_states.shape)


def route_hf_moe(busy: Callable[[], AbstractContextManager[None]]) -> Callable[[], None]:
    """Point the imported HF sparse MoE block classes' ``forward`` at ``engine_block``; the
    undo."""
    undo = []
    for model_type, name in _BLOCKS.items():
        cls = getattr(sys.modules.get(f"transformers.models.{model_type}.modeling_{model_type}"),
                      name, None)
        if cls is None:
            continue
        stock = cls.__dict__["forward"]

        def forward(self, hidden_states, _stock=stock):
            return engine_block(_stock, busy, self, hidden_states)

        cls.forward = forward
        undo.append((cls, stock))
    return lambda: [setattr(cls, "forward", stock) for cls, stock in undo]
