"""The launch cache (ops/triton/launcher.py) runs the very kernel ``kernel[grid]`` runs.

A ``Launcher`` compiles through ``kernel[grid]`` on a key's first call and afterwards calls the
generated C launcher directly (``_DIRECT_VERSIONS``) or ``CompiledKernel.run`` (launch hooks set,
other Triton versions). Each route must give the bits of the first call on the same inputs --
including calls with unaligned pointers and other row counts, which must not reuse a variant
compiled for different specializations.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

import triton  # noqa: E402

from samebits.ops.triton import launcher  # noqa: E402
from samebits.ops.triton import linear as L  # noqa: E402
from samebits.ops.triton import rms_norm as N  # noqa: E402

K, OUT = 512, 768


def _inputs(m: int, offset: int = 0):
    g = torch.Generator(device="cuda").manual_seed(m + offset)
    x = torch.randn(m * K + offset, device="cuda", generator=g).bfloat16()[offset:].view(m, K)
    w = (torch.randn(OUT, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    wn = torch.randn(K, device="cuda", generator=g).bfloat16()
    return x, w, wn


def _ops(x, w, wn):
    h, summed = N.add_rms_norm(x, x.flip(0).contiguous(), wn, 1e-6)
    return L.linear(h, w), N.rms_norm(x, wn, 1e-6), summed


@pytest.mark.parametrize("m", [1, 16, 96])
@pytest.mark.parametrize("offset", [0, 3])  # 3 elements: x's pointer not 16-byte aligned
def test_cached_launches_equal_the_first_launch_bitwise(m, offset):
    first = _ops(*_inputs(m, offset))
    torch.cuda.synchronize()
    for _ in range(3):
        again = _ops(*_inputs(m, offset))
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_direct_route_is_taken_on_known_triton_and_hooks_route_through_run():
    x, w, wn = _inputs(16)
    expected = _ops(x, w, wn)
    dev = torch.cuda.current_device()
    keys = [(ops, key) for ops in (L._LINEAR, N._RMS_NORM) for d, key in ops._launch if d == dev]
    assert keys
    known = triton.__version__.startswith(launcher._DIRECT_VERSIONS)
    assert all((ops.direct(key, dev) is not None) == known for ops, key in keys)
    seen, original = [], launcher.knobs.runtime.launch_enter_hook
    try:
        launcher.knobs.runtime.launch_enter_hook = seen.append
        assert all(ops.direct(key, dev) is None for ops, key in keys)
        hooked = _ops(x, w, wn)
    finally:
        launcher.knobs.runtime.launch_enter_hook = original
    assert len(seen) == 3  # add_rms_norm, linear, rms_norm: each launch reached the hook
    assert all(torch.equal(a, b) for a, b in zip(expected, hooked, strict=True))


def test_tensor_maps_are_not_reused_across_shapes_at_one_address():
    """The TMA route caches its C launcher's arguments (the encoded tensor maps) by launch key,
    M and addresses: a longer view of the same storage must not run with the shorter view's map
    (rows past it would read as zeros)."""
    x, w, _ = _inputs(128)
    assert L.pick_config(96, OUT, K, x.dtype).tma
    L.linear(x[:80].clone(), w)  # compiles the key: the calls below take the cached route
    short = L.linear(x[:80], w)
    full = L.linear(x[:96], w)
    assert torch.equal(full[:80], short)
    assert torch.equal(full[80:], L.linear(x[80:96].clone(), w))


def test_unaligned_pointers_get_their_own_launch_key():
    """Triton specializes on 16-byte pointer alignment: an unaligned x must not reuse the
    variant compiled for an aligned one."""
    aligned_x, w, _ = _inputs(16)
    unaligned_x, _, _ = _inputs(16, 3)
    keys = {L._plan(16, OUT, K, x.dtype, w.dtype, x.dtype, False, None, x.stride(0),
                    w.stride(0), OUT, L.pick_config(16, OUT, K, x.dtype), segments=1, pdl=False,
                    offsets=tuple(t.data_ptr() % 16 for t in (x, w, x, x)),
                    contiguous=True).key
            for x in (aligned_x, unaligned_x)}
    assert len(keys) == 2


def test_tensors_on_another_device_are_refused_after_the_launch_is_cached():
    """The cached route passes pointers as ints (no driver check): a weight on the CPU must
    still be refused with a clear error, never read through a host address."""
    x, w, wn = _inputs(16)
    _ops(x, w, wn)  # cached
    with pytest.raises(ValueError, match="w on cpu"):
        N.rms_norm(x, wn.cpu(), 1e-6)
    with pytest.raises(ValueError, match="w on cpu"):
        L.linear(x, w.cpu())
    with pytest.raises(ValueError, match="residual on cpu"):
        N.add_rms_norm(x, x.cpu(), wn, 1e-6)
    with pytest.raises(ValueError, match="cpu"):  # all on the CPU: Triton's checked route
        N.rms_norm(x.cpu(), wn.cpu(), 1e-6)
