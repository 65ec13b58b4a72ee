"""Tensor parallelism whose bits do not depend on the number of devices.

Every sharded linear works in a fixed number of segments S (the model's KV heads), whatever the
tensor-parallel size N (which must divide S): column-parallel linears (qkv, gate/up, the LM head)
run one product per output segment, row-parallel ones (o_proj, down_proj) one partial product per
K segment, and the partials are all-gathered and added in segment order. A rank owns S/N whole
segments, so every product has the same shape on any N and the sum the same order: N = 1, 2, 3...
give bitwise the same logits. The single-device model (``tensor_parallel_size=1``, the default)
computes o_proj and down_proj over the same K segments (``segments.k_bounds``), so it gives these
bits too. Collectives: ``torch.distributed`` (gloo on CPU, NCCL on CUDA); never an all-reduce, whose
order would depend on N.

- ``segments``: which rows/columns of each weight form segment s, and which segments a rank owns;
- ``group``: the process group and the two collectives (ordered sum, gather in rank order);
- ``model``: the sharded decoder (vocab-parallel embedding and LM head, per-group attention);
- ``engine``: rank 0 drives, ranks 1..N-1 run the same forwards (``enable_tensor_parallel``).
"""

from __future__ import annotations

from importlib import import_module

__all__ = ["enable_tensor_parallel", "shutdown"]


def __getattr__(name: str):
    """The engine's entry points load on first use: ``samebits.models.llama`` imports
    ``segments``, and ``engine`` imports the model, so an eager import here would be a cycle."""
    if name in __all__:
        return getattr(import_module("samebits.distributed.engine"), name)
    raise AttributeError(f"module 'samebits.distributed' has no attribute {name!r}")
