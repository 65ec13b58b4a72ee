"""The staged GEMVs' host-side plan (ops/triton/gemv_staged.py; the kernels need a Hopper GPU:
tests/gpu/test_gemv_staged_gpu.py): every stage count fits the shared memory the kernels
allocate, only equal K segments qualify, and nothing but a CUDA tensor is ever routed there."""

from __future__ import annotations

import pytest
import torch

G = pytest.importorskip("samebits.ops.triton.gemv_staged")


@pytest.mark.parametrize("k_steps", [1, 4, 8, 12, 16, 28])
def test_wide_stages_fit_shared_memory(k_steps):
    stages = G._stages(k_steps)
    used = 2 * (stages * G.BLOCK_N * G.BLOCK_K + k_steps * G.ROWS * G.BLOCK_K) + 1024
    assert 0 <= stages <= min(G.MAX_STAGES, k_steps) and used <= G.SMEM_BYTES
    if stages < min(G.MAX_STAGES, k_steps):  # as many as fit: one more would not
        assert used + 2 * G.BLOCK_N * G.BLOCK_K > G.SMEM_BYTES


def test_decode_shapes_get_most_weights_in_flight():
    assert G._stages(8) == 6  # qkv / o_proj chain at K 2048: 6 of 8 tiles early
    assert G._x_stages(8) == 4  # a router at K 2048: all its weights and 4 input tiles


@pytest.mark.parametrize("k_steps", [1, 8, 16, 24])
def test_narrow_stages_leave_room_for_all_its_weights(k_steps):
    x_stages = G._x_stages(k_steps)
    used = 2 * (k_steps * G.NARROW_N + x_stages * G.X_ROWS) * G.BLOCK_K + 1024
    assert x_stages == 0 or used <= G.SMEM_BYTES


def test_only_equal_contiguous_segments_qualify():
    assert G.even_bounds([(0, 2048), (2048, 4096)], 4096)
    assert not G.even_bounds([(0, 1024), (1024, 4096)], 4096)
    assert not G.even_bounds([(2048, 4096), (0, 2048)], 4096)


def test_cpu_tensors_are_never_routed_to_the_staged_kernels():
    x, w = torch.randn(1, 2048).bfloat16(), torch.randn(5120, 2048).bfloat16()
    assert not G.takes(x, w, 1) and not G.supports(x, w, 1)
