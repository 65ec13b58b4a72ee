"""K chains (``OpBackend.row_parallel_chains``): the row-parallel linears' unit of arithmetic.

What the tests prove: ``chain_bounds`` merges whole KV-head segments, and a rank's chains are
whole chains inside its span; the rules give C = S on CPU (``every_segment``), C = 2 at N <= 2
where S is even, else N, on CUDA (``paired_chains``), C = N for the standard mode; with the
CUDA rule on an 8-KV-head layer, one device (two chains) and two ranks (one chain each) return
the same bits, bias included, while four ranks (four chains) do not -- and the negative
controls: one device's two chains differ from one K chain and from eight. A decoder built on a
backend with the CUDA rule runs two chains in every row-parallel layer and says so in its
fingerprint.
"""

from __future__ import annotations

import pytest
import torch

from samebits.config import EngineConfig, ModelConfig
from samebits.distributed.group import TPGroup
from samebits.loader import build_model, numerics_fingerprint
from samebits.models.parallel import RowParallelLinear, ShardSpec
from samebits.ops import get_backend
from samebits.ops.backend import (
    bounds,
    chain_bounds,
    every_segment,
    one_chain_per_rank,
    one_device_bounds,
    paired_chains,
)
from samebits.ops.reference import ReferenceBackend
from tests.tiny_models import TP_LLAMA_CONFIG
from tests.unit.test_segmented_k import _data, _Exchange

OPS = get_backend("cpu", batch_invariant=True)


class PairedCPU(ReferenceBackend):
    """The CPU arithmetic with the CUDA backend's chain rule."""

    row_parallel_chains = staticmethod(paired_chains)


def test_chain_bounds_merge_whole_segments():
    cuts = bounds(200, 8)
    assert chain_bounds(200, 8, 2) == ((0, cuts[3][1]), (cuts[4][0], 200))
    assert chain_bounds(200, 8, 8) == tuple(cuts)
    assert chain_bounds(200, 8, 1) == ((0, 200),)
    with pytest.raises(ValueError, match="3 K chains do not divide the 8"):
        chain_bounds(200, 8, 3)


@pytest.mark.parametrize("n,chains", [(1, 2), (2, 2), (2, 4), (4, 4), (8, 8)])
def test_a_ranks_chains_are_whole_chains_of_its_span(n, chains):
    for r in range(n):
        spec = ShardSpec(1, (320,), 8, r, n)
        lo, hi = spec.span(0)
        mine = chain_bounds(320, 8, chains)[r * chains // n:(r + 1) * chains // n]
        assert (mine[0][0], mine[-1][1]) == (lo, hi)
        assert spec.local_chains(chains) == tuple((a - lo, b - lo) for a, b in mine)


@pytest.mark.parametrize("s,n,cpu,cuda", [(8, 1, 8, 2), (8, 2, 8, 2), (8, 4, 8, 4), (8, 8, 8, 8),
                                          (3, 1, 3, 1), (3, 3, 3, 3), (6, 3, 6, 3), (1, 1, 1, 1)])
def test_chain_rules(s, n, cpu, cuda):
    from samebits.ops.standard import StandardBackend
    from samebits.ops.triton.backend import TritonBackend
    assert every_segment(s, n) == cpu and paired_chains(s, n) == cuda
    assert one_chain_per_rank(s, n) == n
    assert OPS.row_parallel_chains(s, n) == cpu
    assert TritonBackend.row_parallel_chains(s, n) == cuda
    assert StandardBackend.row_parallel_chains(s, n) == n


@pytest.mark.parametrize("chains,n", [(3, 1), (4, 8), (2, 4)])
def test_a_layer_refuses_chains_that_do_not_divide_or_split_over_its_ranks(chains, n):
    with pytest.raises(ValueError, match=f"{chains} K chains: must divide the 8 KV heads"):
        RowParallelLinear(320, 16, 8, TPGroup(0, n), chains)


def _row_parallel(x, w, b, s: int, n: int, chains: int) -> list[torch.Tensor]:
    """Every rank's output of a row-parallel layer over ``n`` ranks (in-process exchange)."""
    exchanged: dict[int, torch.Tensor] = {}
    layers = [RowParallelLinear(w.shape[1], w.shape[0], s, _Exchange(r, n, exchanged), chains,
                                bias=True) for r in range(n)]
    for layer in layers:
        lo, hi = layer.weight.spec.span(0)
        layer.weight.data, layer.bias.data = w[:, lo:hi].clone(), b.clone()
    for _ in range(2):  # the second pass gathers what every rank sent in the first
        outs = [layer.gathered(OPS, x[:, slice(*layer.weight.spec.span(0))]) for layer in layers]
    return outs


def test_paired_chains_one_device_equals_two_ranks_not_four():
    s, k, h = 8, 8 * 40, 48
    x, w = _data(9, k, h, torch.float32, seed=5)  # fp32 outputs: a sum's last bits show
    b = torch.randn(h)
    one = RowParallelLinear(k, h, s, TPGroup(0, 1), paired_chains(s, 1), bias=True)
    one.weight.data, one.bias.data = w.clone(), b.clone()
    want = one(OPS, x)
    assert one.chains(OPS) == chain_bounds(k, s, 2)
    two = _row_parallel(x, w, b, s, 2, paired_chains(s, 2))
    assert all(torch.equal(out, want) for out in two)
    four = _row_parallel(x, w, b, s, 4, paired_chains(s, 4))
    assert not torch.equal(four[0], want)
    # negative controls: the chain count decides the bits
    assert not torch.equal(OPS.linear(x, w, b), want)
    assert not torch.equal(OPS.linear(x, w, b, k_bounds=chain_bounds(k, s, 8)), want)


def test_a_decoder_on_the_cuda_rule_runs_two_chains_and_says_so():
    cfg = ModelConfig.from_dict(TP_LLAMA_CONFIG)  # 6 KV heads
    model = build_model(cfg, PairedCPU(), 64, "cpu", torch.float32)
    rows = [m for m in model.modules() if isinstance(m, RowParallelLinear)]
    assert len(rows) == 4 and all(len(m.k_bounds) == 2 for m in rows)
    assert one_device_bounds(PairedCPU(), 192, 6) == chain_bounds(192, 6, 2)
    config = EngineConfig(model="x", device="cpu")
    paired = numerics_fingerprint(config, cfg, PairedCPU(), "d")
    assert paired != numerics_fingerprint(config, cfg, OPS, "d")  # k-chains 2 against 6
