"""samebits.ops: the batch-invariant op layer, always the invariant implementation for the tensors'
device (CPU reference or Triton on CUDA). Models get their backend from ``get_backend`` instead.
"""

from __future__ import annotations

import torch

from samebits.ops.backend import AttentionMetadata, KBounds, OpBackend, get_backend, store_kv

__all__ = ["AttentionMetadata", "OpBackend", "get_backend", "store_kv", "linear", "rms_norm",
           "softmax", "log_softmax", "attention"]


def _invariant(x: torch.Tensor) -> OpBackend:
    return get_backend(x.device, batch_invariant=True)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           k_bounds: KBounds | None = None) -> torch.Tensor:
    """With ``k_bounds``: the segmented-K product (``samebits.ops.backend``)."""
    return _invariant(x).linear(x, w, b, k_bounds=k_bounds)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """With ``residual``: ``(rms_norm(x + residual), x + residual)``, the sum rounded first."""
    return _invariant(x).rms_norm(x, w, eps, residual)


def softmax(x: torch.Tensor) -> torch.Tensor:
    return _invariant(x).softmax(x)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return _invariant(x).log_softmax(x)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    return _invariant(q).attention(q, k_cache, v_cache, meta, scale)
