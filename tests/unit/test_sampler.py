"""The sampler: counter-based streams, Gumbel noise, greedy ties, top-k / top-p / min-p masks, and
a row's draw independent of the batch it is sampled in. (Reported logprobs are the runner's: see
tests/unit/test_sampling_controls.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from samebits.engine.sampler import gumbel_noise, keep_mask, mix32, sample, stream_key, weights
from samebits.sampling_params import SamplingParams

NEG = -math.inf


def _kept(x: torch.Tensor, params: SamplingParams) -> set[int]:
    """Token ids the filters keep for one row of temperature-scaled logits (the definition)."""
    v = x.shape[-1]
    w, q = weights(x[None])
    top_k = torch.tensor([params.top_k if 0 < params.top_k < v else v])
    top_p = torch.tensor([params.top_p], dtype=torch.float64)
    keep = keep_mask(x[None], q, top_k, top_p) & (w >= params.min_p)
    return {i for i, k in enumerate(keep[0].tolist()) if k}


# ---- stream keys and noise ---------------------------------------------------------------------

def test_stream_key_is_deterministic_and_two_32_bit_words() -> None:
    for seed, index in [(0, 0), (1, 7), (2**40 + 3, 123), (2**63 - 1, 2**20)]:
        k = stream_key(seed, index)
        assert k == stream_key(seed, index)
        assert len(k) == 2 and all(isinstance(w, int) and 0 <= w < 2**32 for w in k)


def test_stream_key_distinct_for_every_seed_index_pair_of_a_realistic_grid() -> None:
    seeds = list(range(64)) + [2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**62 + 5,
                               2**63 - 1, 1234567890123456789]
    keys = {stream_key(s, i) for s in seeds for i in range(512)}
    assert len(keys) == len(seeds) * 512


def test_stream_key_for_one_seed_is_a_bijection_of_the_index() -> None:
    # mix32 is invertible on 32 bits, so a request never sees the same key twice (index < 2**32)
    keys = [stream_key(42, i) for i in range(20000)]
    assert len(set(keys)) == len(keys)


def test_mix32_on_python_ints_equals_mix32_on_int64_tensors() -> None:
    xs = [0, 1, 2, 0x9E3779B9, 2**32 - 1, 123456789, 2**31]
    t = mix32(torch.tensor(xs, dtype=torch.int64))
    assert t.tolist() == [mix32(x) for x in xs]


def test_distinct_63_bit_seeds_never_share_a_whole_random_stream() -> None:
    c = 0x9E3779B9
    pair = None
    for lo1 in range(1, 64):  # find a colliding pair below 2**63 (the engine draws 63-bit seeds)
        hi = mix32(lo1 ^ c) ^ mix32(0 ^ c)
        if hi < 2**31:
            pair = ((hi << 32) | lo1, 0)
            break
    assert pair is not None
    s1, s2 = pair
    assert s1 != s2 and s1 < 2**63
    assert [stream_key(s1, i) for i in range(64)] != [stream_key(s2, i) for i in range(64)]


def test_gumbel_noise_is_a_pure_function_of_key_and_token_id() -> None:
    keys = torch.tensor([stream_key(s, i) for s in (1, 2, 3) for i in (0, 1, 5, 9)],
                        dtype=torch.int64)
    full = gumbel_noise(keys, 1000)
    assert full.dtype == torch.float32 and full.shape == (12, 1000)
    assert torch.isfinite(full).all()
    # any subset of rows, in any order, alone or in a batch: the same noise per row
    for b in range(1, 13):
        assert torch.equal(gumbel_noise(keys[:b], 1000), full[:b])
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    assert torch.equal(gumbel_noise(keys[perm], 1000), full[perm])
    for r in range(12):
        assert torch.equal(gumbel_noise(keys[r:r + 1], 1000)[0], full[r])
    # token v's noise does not depend on the vocabulary size either
    assert torch.equal(gumbel_noise(keys, 37), full[:, :37])
    # duplicate keys give duplicate rows; different keys give different rows
    dup = gumbel_noise(keys[[3, 3]], 1000)
    assert torch.equal(dup[0], dup[1])
    assert not torch.equal(full[0], full[1])


def test_gumbel_noise_has_gumbel_mean_and_variance() -> None:
    keys = torch.tensor([stream_key(7, i) for i in range(64)], dtype=torch.int64)
    g = gumbel_noise(keys, 4096).double()
    assert abs(g.mean().item() - 0.5772156649) < 0.02  # Euler-Mascheroni
    assert abs(g.var().item() - math.pi ** 2 / 6) < 0.05


# ---- greedy ------------------------------------------------------------------------------------

@pytest.mark.smoke
def test_greedy_ties_go_to_the_lowest_token_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0],
                           [5.0, 5.0, 5.0, 5.0],
                           [-1.0, -2.0, -1.0, -1.0],
                           [0.0, 0.0, 2.0, 2.0]])
    g = SamplingParams(temperature=0.0)
    tokens = sample(logits, [g] * 4, [0] * 4, [0] * 4)
    assert tokens == [1, 0, 0, 2]


def test_greedy_ties_lowest_id_in_a_large_vocab_alone_and_batched() -> None:
    v = 49152
    logits = torch.randn(8, v, generator=torch.Generator().manual_seed(0))
    for r in range(8):
        top = logits[r].max().item() + 1.0
        for t in (v - 1, 40000 - r, 12345 + r, 30000):
            logits[r, t] = top
    g = SamplingParams(temperature=0.0)
    tokens = sample(logits, [g] * 8, [0] * 8, [0] * 8)
    assert tokens == [12345 + r for r in range(8)]
    for r in range(8):
        assert sample(logits[r:r + 1], [g], [0], [0]) == [12345 + r]


# ---- masks -------------------------------------------------------------------------------------

def test_top_k_keeps_exactly_the_k_largest() -> None:
    x = torch.tensor([0.1, 0.5, 0.3, 0.9, 0.7, -2.0])
    assert _kept(x, SamplingParams(top_k=1)) == {3}
    assert _kept(x, SamplingParams(top_k=2)) == {3, 4}
    assert _kept(x, SamplingParams(top_k=4)) == {1, 2, 3, 4}
    for off in (0, -1, 6, 100):
        assert _kept(x, SamplingParams(top_k=off)) == set(range(6))


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    x = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125]))
    assert _kept(x, SamplingParams(top_p=0.3)) == {0}
    assert _kept(x, SamplingParams(top_p=0.6)) == {0, 1}
    assert _kept(x, SamplingParams(top_p=0.8)) == {0, 1, 2}
    assert _kept(x, SamplingParams(top_p=1.0)) == {0, 1, 2, 3}
    # order in the vocabulary does not matter
    y = x[[2, 0, 3, 1]]
    assert _kept(y, SamplingParams(top_p=0.6)) == {1, 3}


def test_top_p_breaks_ties_by_lowest_token_id() -> None:
    x = torch.zeros(6)  # uniform: 1/6 each; 0.4 needs three tokens
    assert _kept(x, SamplingParams(top_p=0.4)) == {0, 1, 2}
    x = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0])
    assert _kept(x, SamplingParams(top_p=0.3)) == {1}


def test_top_p_excludes_the_token_after_the_mass_reaches_p_exactly() -> None:
    assert _kept(torch.zeros(4), SamplingParams(top_p=0.5)) == {0, 1}
    assert _kept(torch.zeros(8), SamplingParams(top_p=0.25)) == {0, 1}


def test_min_p_keeps_tokens_with_probability_at_least_min_p_times_the_max() -> None:
    x = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125]))
    assert _kept(x, SamplingParams(min_p=0.6)) == {0}
    assert _kept(x, SamplingParams(min_p=0.3)) == {0, 1}
    assert _kept(x, SamplingParams(min_p=0.2)) == {0, 1, 2, 3}
    assert _kept(x, SamplingParams(min_p=0.0)) == {0, 1, 2, 3}
    assert _kept(x, SamplingParams(min_p=1.0)) == {0}


def test_filters_compose_top_k_then_top_p_then_min_p() -> None:
    x = torch.log(torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1]))
    # top_k=3 keeps {1,2,3} (renormalised 0.47, 0.35, 0.18); top_p=0.7 keeps {1,2}
    assert _kept(x, SamplingParams(top_k=3, top_p=0.7)) == {1, 2}
    # min_p=0.5 on top of top_k=3: 0.3/0.4 >= 0.5, 0.15/0.4 < 0.5
    assert _kept(x, SamplingParams(top_k=3, min_p=0.5)) == {1, 2}
    assert _kept(x, SamplingParams(top_k=4, min_p=0.3)) == {1, 2, 3}


def test_filters_see_the_temperature_scaled_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    p = SamplingParams(top_p=0.7, temperature=1.0)
    hot = SamplingParams(top_p=0.7, temperature=2.0)  # flatter: [.37, .26, .18, .18]
    draws = {1.0: set(), 2.0: set()}
    for params in (p, hot):
        n = 300
        tokens = sample(logits.expand(n, 4).contiguous(), [params] * n, [3] * n,
                           list(range(n)))
        draws[params.temperature] = set(tokens)
    assert draws[1.0] == {0, 1}
    assert draws[2.0] == {0, 1, 2}


def test_masked_tokens_are_never_sampled() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 50, generator=gen)
    params = SamplingParams(temperature=1.5, top_k=5)
    n = 500
    tokens = sample(logits.expand(n, 50).contiguous(), [params] * n, [11] * n,
                       list(range(n)))
    top5 = set(logits[0].topk(5).indices.tolist())
    assert set(tokens) <= top5 and len(set(tokens)) == 5


def test_top_k_keeps_exactly_k_tokens_lowest_ids_first_when_logits_tie() -> None:
    x = torch.tensor([1.0, 2.0, 2.0, 2.0, 0.0])
    assert _kept(x, SamplingParams(top_k=2)) == {1, 2}


# ---- batch invariance --------------------------------------------------------------------------

def _forty_rows() -> tuple[torch.Tensor, list[SamplingParams], list[int], list[int]]:
    gen = torch.Generator().manual_seed(5)
    v = 1000
    logits = torch.randn(40, v, generator=gen) * 3
    logits[:, 7] = logits[:, 3]  # some ties
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.3, top_p=0.9),
        SamplingParams(temperature=0.9, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.8, min_p=0.02),
        SamplingParams(temperature=0.5, top_p=0.5),
        SamplingParams(temperature=2.0, top_k=3),
    ]
    params = [kinds[i % len(kinds)] for i in range(40)]
    seeds = [1000 + 17 * i for i in range(40)]
    indices = [(5 * i) % 13 for i in range(40)]
    return logits, params, seeds, indices


def test_row_token_bitwise_equal_alone_or_in_a_batch_of_40() -> None:
    # The noise is elementwise, so the standard backend would pass too; the control is that
    # changing the index changes draws.
    logits, params, seeds, indices = _forty_rows()
    tokens = sample(logits, params, seeds, indices)
    for r in range(40):
        assert sample(logits[r:r + 1], [params[r]], [seeds[r]], [indices[r]]) == [tokens[r]], r
    # reversed and rotated batches, and sub-batches of sampled rows only
    order = list(range(39, -1, -1))
    t_rev = sample(logits[order], [params[i] for i in order], [seeds[i] for i in order],
                   [indices[i] for i in order])
    assert t_rev == [tokens[i] for i in order]
    sub = [i for i in range(40) if not params[i].greedy][::3]
    t_sub = sample(logits[sub], [params[i] for i in sub], [seeds[i] for i in sub],
                   [indices[i] for i in sub])
    assert t_sub == [tokens[i] for i in sub]
    # sensitivity: the draw really depends on (seed, index)
    assert sample(logits, params, seeds, [i + 1 for i in indices]) != tokens


def test_empirical_distribution_matches_softmax_at_temperature_one() -> None:
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 4000
    logits = torch.log(p)[None].expand(n, 4).contiguous()
    params = [SamplingParams(temperature=1.0)] * n
    tokens = sample(logits, params, [2024] * n, list(range(n)))
    counts = torch.bincount(torch.tensor(tokens), minlength=4).double()
    expected = p.double() * n
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 30, (counts.tolist(), chi2)  # 3 dof: P(chi2 > 30) ~ 1e-6
    assert ((counts / n - p.double()).abs() < 0.03).all()


def test_empirical_distribution_over_seeds_matches_softmax() -> None:
    p = torch.tensor([0.7, 0.2, 0.05, 0.05])
    n = 4000
    logits = torch.log(p)[None].expand(n, 4).contiguous()
    tokens = sample(logits, [SamplingParams()] * n, list(range(n)), [0] * n)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).double() / n
    assert ((freq - p.double()).abs() < 0.03).all(), freq.tolist()


# ---- exact masses --------------------------------------------------------------------------------

def test_keep_set_of_a_row_ignores_its_neighbours_on_flat_tied_and_masked_rows() -> None:
    gen = torch.Generator().manual_seed(7)
    v = 3000
    rows = [torch.randn(v, generator=gen) * s for s in (0.01, 1.0, 8.0)]
    rows.append(torch.zeros(v))  # all tied
    coarse = (torch.randn(v, generator=gen) * 4).round()  # ties everywhere
    rows.append(coarse)
    masked = torch.randn(v, generator=gen)
    masked[torch.randperm(v, generator=gen)[:2 * v // 3]] = -math.inf  # grammar / min_tokens masks
    rows.append(masked)
    x = torch.stack(rows)
    b = x.shape[0]
    k = torch.tensor([v, 5, 50, 1, 700, 40])
    p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.3, 0.999], dtype=torch.float64)
    _, q = weights(x)
    batch = keep_mask(x, q, k, p)
    for r in range(b):
        assert torch.equal(keep_mask(x[r:r + 1], q[r:r + 1], k[r:r + 1], p[r:r + 1])[0], batch[r])
        assert 1 <= int(batch[r].sum()) <= int(k[r])
    # reversed batch order: same rows
    assert torch.equal(keep_mask(x.flip(0), q.flip(0), k.flip(0), p.flip(0)), batch.flip(0))
