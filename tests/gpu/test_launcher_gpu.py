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
    launches = [f for table in (L._LINEAR._launch, N._RMS_NORM._launch) for f in table.values()]
    assert launches
    known = triton.__version__.startswith(launcher._DIRECT_VERSIONS)
    assert all(f.direct == known for f in launches)
    seen, original = [], launcher.knobs.runtime.launch_enter_hook
    try:
        launcher.knobs.runtime.launch_enter_hook = seen.append
        hooked = _ops(x, w, wn)
    finally:
        launcher.knobs.runtime.launch_enter_hook = original
    assert len(seen) == 3  # add_rms_norm, linear, rms_norm: each launch reached the hook
    assert all(torch.equal(a, b) for a, b in zip(expected, hooked, strict=True))


def test_tensor_maps_are_not_reused_across_shapes_at_one_address():
    """The TMA route caches encoded tensor maps by address, shape, strides and block: a longer
    view of the same storage must not run with the shorter view's map (rows past it would read
    as zeros)."""
    x, w, _ = _inputs(128)
    assert L.pick_config(96, OUT, K, x.dtype).tma
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
                    w.stride(0), OUT, L.pick_config(16, OUT, K, x.dtype), 1, None, False,
                    tuple(t.data_ptr() % 16 for t in (x, w, x, x)), True).key
            for x in (aligned_x, unaligned_x)}
    assert len(keys) == 2
