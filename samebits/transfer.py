"""Host values to device tensors without waiting for the device.

``torch.tensor(values, device="cuda")`` copies from pageable memory and then synchronizes the
stream: the host stalls until every kernel queued before it has finished, and the device then
idles while the host launches what comes next. A step that must not stall (a decode step's
sampling, queued behind the model's forward) copies through pinned memory instead: the copy is
queued on the current stream like a kernel, and torch's caching host allocator keeps the pinned
buffer until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: Sequence | np.ndarray, dtype: torch.dtype, device: torch.device | str
              ) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``, queued without a host sync on CUDA
    (a numpy array is read in place, not element by element)."""
    host = (torch.from_numpy(values).to(dtype) if isinstance(values, np.ndarray)
            else torch.tensor(values, dtype=dtype))
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
