"""Host values to device tensors, and device tensors back to the host, without a stream sync.

``torch.tensor(values, device="cuda")`` copies from pageable memory and then synchronizes the
stream: the host stalls until every kernel queued before it has finished, and the device then
idles while the host launches what comes next. A step that must not stall (a decode step's
sampling, queued behind the model's forward) copies through pinned memory instead: the copy is
queued on the current stream like a kernel, and torch's caching host allocator keeps the pinned
buffer until the copy has run. The way back (``to_host_later``) copies into pinned memory
behind an event, so the host waits for that copy alone, not for work queued after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def to_host_later(t: torch.Tensor) -> Callable[[], list]:
    """Queue the copy of ``t`` to the host; the returned function waits for that copy only and
    gives ``t.tolist()``'s value (on CPU, ``t.tolist()`` when called)."""
    if not t.is_cuda:
        return t.tolist
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def wait() -> list:
        copied.synchronize()
        return host.tolist()
    return wait
