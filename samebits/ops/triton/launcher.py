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

On a Triton whose launcher layout is known (``_DIRECT_VERSIONS``) and with no launch hooks set,
the call skips ``CompiledKernel.run``'s Python wrapper too and calls the generated C launcher with
the arguments that wrapper would pass (no scratch buffers: kernels that need them take the wrapper).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import types
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

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
    the kernel's ``PDL`` constexpr): while a CUDA graph is being captured (decode steps) or under
    ``as_captured``, on compute capability 9+, with a Triton that has grid dependency control. It
    only moves launches earlier, never changes a result. Other eager launches keep plain stream
    order: there the host's launch cost, not the device's, sets the pace, and an eager PDL launch
    after a graph replay measured slower (H100)."""
    return (t.is_cuda and _programmatic_device(t.get_device())
            and (_capturing() or _AS_CAPTURED.get()))


def _capturing() -> bool:
    return torch._C._cuda_isCurrentStreamCapturing()


_AS_CAPTURED = contextvars.ContextVar("as_captured", default=False)


@contextlib.contextmanager
def as_captured() -> Iterator[None]:
    """Eager launches inside take the kernel variants a graph capture takes (``programmatic``).
    The warm-up run before a capture runs under it, so every kernel the capture launches is
    compiled and loaded before: nothing is compiled while capturing (a module load or a stray
    host call then can invalidate the capture)."""
    token = _AS_CAPTURED.set(True)
    try:
        yield
    finally:
        _AS_CAPTURED.reset(token)


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


class Descriptor(NamedTuple):
    """A tensor-descriptor (TMA) argument: ``tensor`` loaded or stored in ``block``-shaped tiles.
    A Launcher builds Triton's host descriptor from it; on the direct route it reuses the tensor
    map encoded for an equal (address, shape, strides, block), a pure function of them."""

    tensor: torch.Tensor
    block: tuple[int, ...]

    def host(self) -> TensorDescriptor:
        return TensorDescriptor.from_tensor(self.tensor, list(self.block))


def _host_args(args: tuple) -> tuple:
    return tuple(a.host() if isinstance(a, Descriptor) else a for a in args)


class Launcher:
    """``Launcher(kernel)(key, grid, *args, **options)`` == ``kernel[grid](*args, **options)``,
    with the compiled kernel looked up by ``key`` after the first call. ``args`` are every kernel
    parameter in order, constexprs included (positionally); tensor-descriptor parameters take a
    ``Descriptor``."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._launch: dict[tuple, Callable] = {}  # (device, key) -> _bind(compiled kernel)
        self._ids: dict[tuple, int] = {}

    def intern(self, key: tuple) -> int:
        """A small int standing for ``key`` (one per distinct key), to build once per cached
        plan and pass as the launch key: a lookup then hashes one int, not the whole key."""
        return self._ids.setdefault(key, len(self._ids))

    def __call__(self, key: tuple, grid: tuple[int, ...], *args, **options) -> None:
        device = torch._C._cuda_getDevice() if torch.cuda.is_initialized() else -1
        launch = self._launch.get((device, key))
        if launch is None:
            compiled = self.kernel[grid](*_host_args(args), **options)
            if compiled is not None and hasattr(compiled, "run"):  # None under the interpreter
                self._launch[(device, key)] = _bind(compiled)
            return
        launch(grid, torch._C._cuda_getCurrentRawStream(device), args)


# Triton versions whose CudaLauncher.__call__ passes (grid, stream, function, cooperative, pdl,
# global scratch, profile scratch, packed metadata, launch metadata, enter hook, exit hook, *args)
# to the generated C launcher, and whose descriptor arguments expand through
# ``make_tensordesc_arg(descriptor, metadata)``.
_DIRECT_VERSIONS = ("3.6.",)
_TENSOR_MAPS = 512  # encoded tensor maps kept per compiled kernel


def _bind(compiled) -> Callable[[tuple, int, tuple], None]:
    """``launch(grid, stream, args)`` for one compiled kernel (``launch.compiled``): the C
    launcher itself where the layout is known, no hook is set and no scratch is needed, else
    ``compiled.run``."""
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    descs = [i for i, ty in enumerate(compiled.src.signature.values())
             if isinstance(ty, str) and ty.startswith("tensordesc")]
    metas = getattr(compiled.metadata, "tensordesc_meta", None) or [None] * len(descs)
    c_launch = _raw(getattr(run, "launch", None)) if descs else getattr(run, "launch", None)
    direct = (triton.__version__.startswith(_DIRECT_VERSIONS)
              and isinstance(c_launch, types.BuiltinFunctionType)
              and not getattr(run, "global_scratch_size", 1)
              and not getattr(run, "profile_scratch_size", 1)
              and all(m is not None for m in metas))
    cooperative, pdl = getattr(run, "launch_cooperative_grid", 0), getattr(run, "launch_pdl", 0)
    expand = _expander(descs, metas) if descs and direct else None

    def launch(grid: tuple, stream: int, args: tuple) -> None:
        gx, gy, gz = grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1
        enter, leave = _hooks()
        if direct and enter is None and leave is None:
            c_launch(gx, gy, gz, stream, function, cooperative, pdl, None, None, packed, None,
                     None, None, *(args if expand is None else expand(args)))
            return
        args = _host_args(args) if descs else args
        meta = None if enter is None else compiled.launch_metadata(grid, stream, *args)
        run(gx, gy, gz, stream, function, packed, meta, enter, leave, *args)

    launch.compiled, launch.direct = compiled, direct
    return launch


def _raw(wrapper):
    """The generated C launcher inside Triton's descriptor-expanding wrapper (a closure)."""
    cells = getattr(wrapper, "__closure__", None) or ()
    raw = [c.cell_contents for c in cells
           if isinstance(c.cell_contents, types.BuiltinFunctionType)]
    return raw[0] if len(raw) == 1 else None


def _expander(descs: list[int], metas: list) -> Callable[[tuple], list]:
    """args -> the C launcher's arguments: each ``Descriptor`` at ``descs`` replaced by its
    encoded tensor map, shape and strides (``make_tensordesc_arg``), cached by address, shape,
    strides and block."""
    from triton.backends.nvidia.driver import make_tensordesc_arg
    maps: dict[tuple, list] = {}

    def expand(args: tuple) -> list:
        out, prev = [], 0
        for j, i in enumerate(descs):
            d = args[i]
            t = d.tensor
            key = (j, t.data_ptr(), t.shape, t.stride(), t.dtype, d.block)
            encoded = maps.get(key)
            if encoded is None:
                if len(maps) >= _TENSOR_MAPS:
                    maps.clear()
                encoded = maps[key] = make_tensordesc_arg(d.host(), metas[j])
            out.extend(args[prev:i])
            out.extend(encoded)
            prev = i + 1
        out.extend(args[prev:])
        return out

    return expand


def _hooks() -> tuple[Callable | None, Callable | None]:
    """The launch enter and exit hooks, None where none is set (an empty hook chain counts as
    none: the C launcher would call it on every launch)."""
    if knobs is None:
        return None, None
    return _set(knobs.runtime.launch_enter_hook), _set(knobs.runtime.launch_exit_hook)


def _set(hook: Callable | None) -> Callable | None:
    return hook if hook is not None and getattr(hook, "calls", True) else None
