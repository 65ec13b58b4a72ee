"""The launch cache's host-side pieces (ops/triton/launcher.py), on the CPU: the pointer
alignment that goes into launch keys, the launch-hook check that sends launches through Triton's
own route, and the argument layout the direct route gives the generated C launcher. The launches
themselves run in tests/gpu/test_launcher_gpu.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from samebits.ops.triton import launcher  # noqa: E402


def test_alignment_sets_a_bit_for_each_16_byte_aligned_pointer():
    assert launcher.alignment(0, 16, 3, 4096 + 8) == 0b0011
    base = torch.zeros(64, dtype=torch.float32)
    assert base.data_ptr() % 16 == 0
    # a tensor 1 float (4 bytes) in is unaligned; None counts as unaligned
    assert launcher.aligned(base, base[1:], None, base[4:]) == 0b1001


def test_hooked_only_while_a_launch_hook_is_set():
    if launcher.knobs is None:
        pytest.skip("this Triton has no launch hooks")
    runtime = launcher.knobs.runtime
    original = runtime.launch_enter_hook
    assert not launcher._hooked()  # the default hook chains are empty
    try:
        runtime.launch_enter_hook = lambda metadata: None
        assert launcher._hooked()
    finally:
        runtime.launch_enter_hook = original
    assert not launcher._hooked()


def test_direct_passes_the_generated_launchers_argument_layout():
    """(grid x, y, z, stream, function, cooperative, pdl, global scratch, profile scratch,
    packed metadata, launch metadata, enter hook, exit hook, *kernel args): Triton 3.6's
    CudaLauncher.__call__ with no scratch and no hooks."""
    calls = []
    direct = launcher.Direct(lambda *a: calls.append(a), 0, 77, 0, 1, (4, 1, 0), ())
    direct.on(123, (5, 2, 1), (1000, 2000, 7))
    assert calls == [(5, 2, 1, 123, 77, 0, 1, None, None, (4, 1, 0), None, None, None,
                      1000, 2000, 7)]
