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
The leanest route is ``Launcher.direct``: the caller passes data pointers as ints (the C launcher
then skips its driver query per pointer) and tensor descriptors already encoded, which it caches.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
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
    wait at this same statement before they read or write any tensor another kernel may still
    write. Before the wait a kernel reads only what is final once it starts: weights, and
    tensors written before the previous kernel started (the step's metadata; the MoE down GEMM's
    expert ids). So every load and store sees the stream's order."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def programmatic(t: torch.Tensor) -> bool:
    """Launch kernels on ``t``'s device with programmatic dependent launch (``launch_pdl`` and
    the kernel's ``PDL`` constexpr): under ``as_captured`` (the engine's graph warm-ups and
    captures), on compute capability 9+, with a Triton that has grid dependency control. It only
    moves launches earlier, never changes a result. Other launches keep plain stream order: an
    eager caller's pace is set by the host's launch cost, an eager PDL launch after a graph replay
    measured slower (H100), and a capture outside ``as_captured`` then launches the variants its
    eager warm-up compiled. One ContextVar read per launch, no driver call."""
    return _AS_CAPTURED.get() and programmatic_device(t)


def programmatic_device(t: torch.Tensor) -> bool:
    """Whether ``t``'s device launches with programmatic dependent launch under ``as_captured``
    (tile policies that pay only then ask this)."""
    return t.is_cuda and _programmatic_device(t.get_device())


_AS_CAPTURED = contextvars.ContextVar("as_captured", default=False)


@contextlib.contextmanager
def as_captured() -> Iterator[None]:
    """Launches inside take the engine's graph variants (``programmatic``). The engine runs
    both its warm-up and its capture under it, so every kernel the capture launches is compiled
    and loaded before: nothing is compiled while capturing (a module load or a stray host call
    then can invalidate the capture)."""
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
    return alignment(*(1 if t is None else t.data_ptr() for t in ts))  # None: no bit


def alignment(*ptrs: int) -> int:
    """``aligned`` of the tensors with these data pointers."""
    bits = 0
    for i, ptr in enumerate(ptrs):
        if not ptr & 15:
            bits |= 1 << i
    return bits


class Descriptor(NamedTuple):
    """A tensor-descriptor (TMA) argument: ``tensor`` loaded or stored in ``block``-shaped tiles.
    ``Launcher.__call__`` builds Triton's host descriptor from it; ``Direct.tensor_maps`` encodes
    it for the C launcher (a pure function of address, shape, strides, dtype and block, which
    callers cache)."""

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
    ``Descriptor``.

    ``direct(key, device)`` is the lean route for a caller that has built the C launcher's
    arguments itself (pointers as ints, descriptors expanded by ``Direct.tensor_maps``): a check
    for launch hooks, one of the device and one dict lookup."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._launch: dict[tuple, Callable] = {}  # (device, key) -> _bind(compiled kernel)
        self._direct: dict[tuple, Direct] = {}  # (device, key) -> its C launcher, where known
        self._ids: dict[tuple, int] = {}
        self._lock = threading.Lock()

    def intern(self, key: tuple) -> int:
        """A small int standing for ``key`` (one per distinct key), to build once per cached
        plan and pass as the launch key: a lookup then hashes one int, not the whole key."""
        with self._lock:  # two threads must not give two keys one id
            return self._ids.setdefault(key, len(self._ids))

    def __call__(self, key: tuple, grid: tuple[int, ...], *args, **options) -> None:
        device = torch._C._cuda_getDevice() if torch.cuda.is_initialized() else -1
        launch = self._launch.get((device, key))
        if launch is None:
            compiled = self.kernel[grid](*_host_args(args), **options)
            if compiled is not None and hasattr(compiled, "run"):  # None under the interpreter
                direct = _direct(compiled, device)
                self._launch[(device, key)] = _bind(compiled, direct)
                if direct is not None:
                    self._direct[(device, key)] = direct
            return
        launch(grid, torch._C._cuda_getCurrentRawStream(device), args)

    def direct(self, key: int | tuple, device: int) -> Direct | None:
        """The compiled kernel of ``key`` as a ``Direct`` launch on ``device`` (the index of the
        tensors' GPU, ``get_device()``); None before the key's first ``__call__`` there, on a
        Triton whose launcher layout is not known, while a launch hook is set (``__call__``
        honours hooks), and when ``device`` is not the current device (a CPU tensor's is -1):
        ``__call__`` then takes Triton's route, which checks every pointer."""
        if not self._direct or _hooked() or device != torch._C._cuda_getDevice():
            return None
        return self._direct.get((device, key))


# Triton versions whose CudaLauncher.__call__ passes (grid, stream, function, cooperative, pdl,
# global scratch, profile scratch, packed metadata, launch metadata, enter hook, exit hook, *args)
# to the generated C launcher, and whose descriptor arguments expand through
# ``make_tensordesc_arg(descriptor, metadata)``.
_DIRECT_VERSIONS = ("3.6.",)


class Direct(NamedTuple):
    """One compiled kernel's generated C launcher, called as ``direct(grid, args)``: ``grid`` a
    3-tuple, ``args`` every kernel parameter in order with pointers as ints (or tensors: the C
    launcher then asks the driver about each pointer) and each tensor descriptor replaced by the
    encoded arguments ``tensor_maps`` returns. Launches on the current stream of ``device``."""

    launch: Callable
    device: int
    function: int
    cooperative: int
    pdl: int
    packed: tuple
    metas: tuple  # the compiled kernel's tensor-descriptor metadata, in parameter order

    def __call__(self, grid: tuple[int, int, int], args: tuple | list) -> None:
        self.on(torch._C._cuda_getCurrentRawStream(self.device), grid, args)

    def on(self, stream: int, grid: tuple[int, int, int], args: tuple | list) -> None:
        """``direct(grid, args)`` on ``stream``."""
        self.launch(*grid, stream, self.function, self.cooperative, self.pdl, None, None,
                    self.packed, None, None, None, *args)

    def tensor_maps(self, descriptors: tuple[Descriptor, ...]) -> tuple:
        """The C launcher's arguments for the kernel's descriptor parameters, in order: each
        one's encoded tensor map, shape and strides (``make_tensordesc_arg``). A pure function
        of the tensors' addresses, shapes, strides, dtypes and the blocks: callers cache it."""
        from triton.backends.nvidia.driver import make_tensordesc_arg
        return tuple(a for d, meta in zip(descriptors, self.metas, strict=True)
                     for a in make_tensordesc_arg(d.host(), meta))


def _direct(compiled, device: int) -> Direct | None:
    """The C launcher of ``compiled`` where its layout is known (``_DIRECT_VERSIONS``) and no
    scratch buffer is needed, else None."""
    run = compiled.run
    descs = [ty for ty in compiled.src.signature.values()
             if isinstance(ty, str) and ty.startswith("tensordesc")]
    metas = tuple(getattr(compiled.metadata, "tensordesc_meta", None) or [None] * len(descs))
    c_launch = _raw(getattr(run, "launch", None)) if descs else getattr(run, "launch", None)
    if not (triton.__version__.startswith(_DIRECT_VERSIONS)
            and isinstance(c_launch, types.BuiltinFunctionType)
            and not getattr(run, "global_scratch_size", 1)
            and not getattr(run, "profile_scratch_size", 1)
            and all(m is not None for m in metas)):
        return None
    return Direct(c_launch, device, compiled.function, getattr(run, "launch_cooperative_grid", 0),
                  getattr(run, "launch_pdl", 0), compiled.packed_metadata, metas)


def _bind(compiled, direct: Direct | None) -> Callable[[tuple, int, tuple], None]:
    """``launch(grid, stream, args)`` for one compiled kernel (``launch.compiled``): ``direct``
    where there is one, the kernel takes no tensor descriptor and no hook is set, else
    ``compiled.run``."""
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    descs = any(isinstance(ty, str) and ty.startswith("tensordesc")
                for ty in compiled.src.signature.values())
    direct = None if descs else direct

    def launch(grid: tuple, stream: int, args: tuple) -> None:
        gx, gy, gz = grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1
        if direct is not None and not _hooked():
            direct.on(stream, (gx, gy, gz), args)
            return
        args = _host_args(args) if descs else args
        enter, leave = _hooks()
        meta = None if enter is None else compiled.launch_metadata(grid, stream, *args)
        run(gx, gy, gz, stream, function, packed, meta, enter, leave, *args)

    launch.compiled = compiled
    return launch


def _raw(wrapper):
    """The generated C launcher inside Triton's descriptor-expanding wrapper (a closure)."""
    cells = getattr(wrapper, "__closure__", None) or ()
    raw = [c.cell_contents for c in cells
           if isinstance(c.cell_contents, types.BuiltinFunctionType)]
    return raw[0] if len(raw) == 1 else None


def _hooks() -> tuple[Callable | None, Callable | None]:
    """The launch enter and exit hooks, None where none is set (an empty hook chain counts as
    none: the C launcher would call it on every launch)."""
    if knobs is None:
        return None, None
    return _set(knobs.runtime.launch_enter_hook), _set(knobs.runtime.launch_exit_hook)


def _hooked() -> bool:
    """Whether a launch enter or exit hook is set (``_hooks`` not both None)."""
    if knobs is None:
        return False
    runtime = knobs.runtime
    return (_set(runtime.launch_enter_hook) is not None
            or _set(runtime.launch_exit_hook) is not None)


def _set(hook: Callable | None) -> Callable | None:
    return hook if hook is not None and getattr(hook, "calls", True) else None
