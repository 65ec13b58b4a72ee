"""The invariant CPU kernels (``csrc/invariant_cpu.cpp``), compiled on first use and cached.

The build (``build``) goes through ``torch.utils.cpp_extension.load`` (g++ and ninja) into torch's
extension cache, under a name carrying the hash of the source and flags: a changed source builds
anew, an unchanged one loads in milliseconds. Builds are safe against a builder killed at any
moment: one process at a time builds (an exclusive ``flock``, which the kernel releases when its
holder dies, never a lock file that outlives it), in a fresh directory of its own, and the library
is renamed into place only once complete. If the build fails, ``load`` raises
``KernelBuildError`` naming the cause; there is no silent fallback (another arithmetic would give
other bits).

``linear`` and ``attention`` state their arithmetic in the C++ file's header; ``ARITHMETIC``, the
digest of that source and the compile flags, names it in the CPU fingerprint (derived, so no edit
of the kernels can leave a stale name).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "invariant_cpu.cpp"
PACK_N = 48  # output columns per packed weight block (the C++ NB)
# -fopenmp: at::parallel_for runs its OpenMP loop only where the including code is built with it
# (the OpenMP runtime is torch's own libgomp, already loaded)
_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
_DIGEST = hashlib.sha256(SOURCE.read_bytes() + repr(_FLAGS).encode()).hexdigest()[:12]
ARITHMETIC = f"cpp-{_DIGEST}"
_lock = threading.Lock()
_loaded = False


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be built (no compiler, no ninja, a compile error)."""


def load() -> None:
    """Build (once per source version) and load the kernels into ``torch.ops.samebits_cpu``."""
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        try:
            build(f"samebits_cpu_{_DIGEST}", [SOURCE], _FLAGS, ["-fopenmp"])
        except Exception as e:  # noqa: BLE001 -- any build failure is reported the same way
            raise KernelBuildError(
                f"could not build samebits' invariant CPU kernels ({SOURCE.name}): {e}. They need "
                "g++ and ninja (pip install ninja); the standard mode (batch_invariant=False) runs "
                "without them.") from e
        _loaded = True


def build(name: str, sources: Sequence[Path], cflags: Sequence[str],
          ldflags: Sequence[str]) -> Path:
    """Load the op library ``name`` (compiled from ``sources``) into this process, building it
    first unless a finished one is kept; returns the library's path.

    Layout, in torch's extension directory for this Python and accelerator: ``NAME.lock`` (the
    flock), ``NAME-torchVERSION.so`` (a finished library: renamed in whole, so present means
    complete), ``NAME.build-*`` (a build in progress, or a killed build's leftovers, removed by
    the next build)."""
    from torch.utils import cpp_extension
    # torch's own per-extension directory (it honours TORCH_EXTENSIONS_DIR); ours sit beside it
    root = Path(cpp_extension._get_build_directory(name, False)).parent
    library = root / f"{name}-torch{torch.__version__}.so"
    if not library.exists():
        with _exclusive(root / f"{name}.lock"):
            if not library.exists():
                return _compile(name, sources, cflags, ldflags, root, library)
    torch.ops.load_library(str(library))
    return library


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """An exclusive flock on ``path`` (blocking); the kernel drops it if this process dies."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _compile(name: str, sources: Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str],
             root: Path, library: Path) -> Path:
    """Build in a fresh directory (loading the result), then rename the library into place."""
    from torch.utils import cpp_extension
    for stale in root.glob(f"{name}.build-*"):  # under the lock: only dead builders' leftovers
        shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=f"{name}.build-", dir=root))
    try:
        cpp_extension.load(name=name, sources=[str(s) for s in sources],
                           extra_cflags=list(cflags), extra_ldflags=list(ldflags),
                           build_directory=str(work), is_python_module=False, verbose=False)
        built = next(work.glob(f"{name}*.so"))  # torch may suffix a rebuilt name (_v1)
        os.replace(built, library)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return library


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> [ceil(N/48), K, 48] (zero-padded columns), the layout ``linear`` streams."""
    n, k = w.shape
    blocks = -(-n // PACK_N)
    if blocks * PACK_N != n:
        w = torch.cat([w, w.new_zeros(blocks * PACK_N - n, k)])
    return w.reshape(blocks, PACK_N, k).transpose(1, 2).contiguous()


def packed(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The packed copy of ``w`` in ``dtype``, kept on the tensor while its storage and version
    (in-place updates) stay the same."""
    try:
        key = (w.data_ptr(), w._version, dtype)
    except RuntimeError:  # an inference tensor has no version counter: pack afresh
        return pack_weight(w.to(dtype))
    cached = getattr(w, "_samebits_packed", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    wp = pack_weight(w.to(dtype))
    w._samebits_packed = (key, wp)
    return wp


def forget_packed(module: torch.nn.Module) -> None:
    """Drop the packed copies kept on ``module``'s parameters: a copy through ``param.data`` (the
    weight loader's) changes the values without bumping the version ``packed`` keys on."""
    for p in module.parameters():
        if hasattr(p, "_samebits_packed"):
            del p._samebits_packed


def linear(x: torch.Tensor, wp: torch.Tensor, n: int,
           k_bounds: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] contiguous @ the packed weight -> [M, n], each element one ascending-K fma chain.

    ``k_bounds`` [0, k1, ..., K] (sorted): each K segment runs its own chain from +0 and the
    segment partials are added in segment order in x's dtype, ((p0 + p1) + p2) ..."""
    load()
    if k_bounds is not None:
        k_bounds = [int(b) for b in (k_bounds.tolist() if isinstance(k_bounds, torch.Tensor)
                                     else k_bounds)]
    return torch.ops.samebits_cpu.linear(x, wp, n, k_bounds)


def set_vectorized(on: bool) -> bool:
    """Let the kernels use AVX2 (default) or only their scalar paths; returns the previous setting.
    Both give the same bits (for tests)."""
    load()
    return torch.ops.samebits_cpu.set_vectorized(on)


def set_avx512(on: bool) -> bool:
    """Let the linear use AVX-512 where the CPU has it (default) or keep to AVX2; returns the
    previous setting. Both give the same bits (for tests)."""
    load()
    return torch.ops.samebits_cpu.set_avx512(on)


def linear_lanes() -> int:
    """The lanes of the linear's registers here under the current settings: 16 (AVX-512), 8
    (AVX2) or 1 (scalar)."""
    load()
    return torch.ops.samebits_cpu.linear_lanes()


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              block_tables: torch.Tensor, q_seq: torch.Tensor, q_nkeys: torch.Tensor,
              scale: float, split: int) -> torch.Tensor:
    """q [T, Hq, D]; caches [blocks, block_size, Hkv, D]; query t reads keys [0, q_nkeys[t]) of
    sequence q_seq[t] (block_tables [B, max_blocks] int32) in splits of ``split``."""
    load()
    return torch.ops.samebits_cpu.attention(q, k_cache, v_cache, block_tables, q_seq, q_nkeys,
                                            scale, split)
