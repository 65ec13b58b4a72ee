"""Eager launches without Triton's per-call Python work.

``kernel[grid](*args)`` binds every argument, recomputes each one's specialization (dtype,
16-byte alignment, divisibility of ints) and hashes them into a cache key on every call: tens of
microseconds of host time, more than the GPU time of a decode-sized GEMM or an RMSNorm. A
``Launcher`` does that once per *launch key* -- a tuple the caller builds from what decides the
compiled variant (dtypes, the specialized int values, alignment of the pointers, the constexprs
and launch options) -- and afterwards calls the compiled kernel's launcher directly: a dict lookup
and one C call.

It never changes what runs: a key maps to the very compiled kernel ``kernel[grid]`` picked the
first time, and the key must separate every argument Triton specializes on (ints that are not
``do_not_specialize``, pointer alignment) -- ``aligned`` computes the pointer part. Like
``kernel[grid]``, it launches on the current device and stream (compiled handles are kept per
device). Under the interpreter (``TRITON_INTERPRET=1``) there is no compiled handle and every call
goes through ``kernel[grid]``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

try:
    from triton import knobs
except ImportError:  # pragma: no cover - older Triton: no launch hooks to honour
    knobs = None


try:  # programmatic dependent launch (Hopper+): the next kernel starts while this one finishes
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - Triton without grid dependency control
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """First statement of a kernel launched with ``launch_pdl=PDL``: wait until the previous
    kernel in the stream has finished and its writes are visible, then let the next kernel
    launch. The next kernel's programs then start (and get resident) while this one runs, and
    wait at this same statement before they read or write any tensor. Nothing is read or written
    before the wait, so the order of every load and store in the stream stays the stream's."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def programmatic(t: torch.Tensor) -> bool:
    """Launch kernels on ``t``'s device with programmatic dependent launch (``launch_pdl`` and
    the kernel's ``PDL`` constexpr): while a CUDA graph is being captured (decode steps), on
    compute capability 9+, with a Triton that has grid dependency control. It only moves launches
    earlier, never changes a result. Eager launches keep plain stream order: there the host's
    launch cost, not the device's, sets the pace, and an eager PDL launch after a graph replay
    measured slower (H100)."""
    return (t.is_cuda and _programmatic_device(t.device.index or 0)
            and torch.cuda.is_current_stream_capturing())


@functools.cache
def _programmatic_device(index: int) -> bool:
    return gdc_wait is not None and torch.cuda.get_device_capability(index)[0] >= 9


def aligned(*ts: torch.Tensor | None) -> int:
    """Bit i set when tensor i's data pointer is 16-byte aligned (Triton's pointer
    specialization), for a launch key."""
    bits = 0
    for i, t in enumerate(ts):
        if t is not None and t.data_ptr() % 16 == 0:
            bits |= 1 << i
    return bits


class Launcher:
    """``Launcher(kernel)(key, grid, *args, **options)`` == ``kernel[grid](*args, **options)``,
    with the compiled kernel looked up by ``key`` after the first call. ``args`` are every kernel
    parameter in order, constexprs included (positionally)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.compiled: dict[tuple, object] = {}

    def __call__(self, key: tuple, grid: tuple[int, ...], *args, **options) -> None:
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else -1
        compiled = self.compiled.get((device, key))
        if compiled is None:
            compiled = self.kernel[grid](*args, **options)
            if compiled is not None and hasattr(compiled, "run"):  # None under the interpreter
                self.compiled[(device, key)] = compiled
            return
        stream = torch._C._cuda_getCurrentRawStream(device)
        enter, leave = _hooks()
        meta = None if enter is None else compiled.launch_metadata(grid, stream, *args)
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                     stream, compiled.function, compiled.packed_metadata, meta, enter, leave, *args)


def _hooks() -> tuple[Callable | None, Callable | None]:
    if knobs is None:
        return None, None
    return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
