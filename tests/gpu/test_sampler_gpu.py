"""The candidate sampler on CUDA: every row's token equals the full-sort definition's, and a row's
token is the same alone or in a batch of 64 (Qwen3's vocabulary size)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from samebits.engine import sampler  # noqa: E402
from samebits.ops import get_backend  # noqa: E402
from samebits.sampling_params import SamplingParams  # noqa: E402

V = 151936
PARAMS = [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.0, top_k=50),
          SamplingParams(temperature=0.7, top_p=0.9, min_p=0.02),
          SamplingParams(temperature=1.3, top_k=20, top_p=0.8)]


def _logits(b: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(b, V, device="cuda", generator=gen) * torch.linspace(1, 8, b, device="cuda")[:, None]
    x[::7, :300] = x[::7].amax(-1, keepdim=True)  # ties across the first candidate boundary
    return x


@pytest.mark.parametrize("params", PARAMS)
def test_gpu_candidate_tokens_equal_the_full_sort_definition(params, monkeypatch):
    ops = get_backend("cuda", True)
    x = _logits(64)
    seeds, idx = list(range(64)), [3] * 64
    fast, _ = sampler.sample(ops, x, [params] * 64, seeds, idx)
    monkeypatch.setattr(sampler, "CANDIDATES", ())
    full, _ = sampler.sample(ops, x, [params] * 64, seeds, idx)
    assert fast == full


def test_gpu_sampled_row_is_the_same_alone_or_in_a_batch_of_64():
    ops = get_backend("cuda", True)
    x = _logits(64)
    params = [PARAMS[i % len(PARAMS)] for i in range(64)]
    batch, _ = sampler.sample(ops, x, params, list(range(64)), [1] * 64)
    alone = [sampler.sample(ops, x[i:i + 1], [params[i]], [i], [1])[0][0] for i in range(64)]
    assert batch == alone
