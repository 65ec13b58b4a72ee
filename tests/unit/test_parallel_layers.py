"""Each tensor-parallel rank builds and reads only its shard.

What they prove: on N = 2 and 3 ranks each rank's sharded parameters (q/k/v and their bias, o,
gate/up, down, embedding, LM head) hold about 1/N of the model's bytes and together exactly the
model's, with only the norms replicated; a parameter's ``weight_loader`` asks a safetensors slice
for exactly the rank's rows (column-parallel, each fused shard) or columns (row-parallel), never the
whole tensor; and a rank loaded from a checkpoint directory holds exactly its slices of the whole
model's weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from samebits.config import EngineConfig
from samebits.distributed.group import TPGroup
from samebits.loader import load
from samebits.models.parallel import QKVParallelLinear, RowParallelLinear, full_bytes
from samebits.models.weights import WeightMap

# 12 query heads, 6 KV heads (N = 2, 3 divide them), an uneven intermediate size, tied head
CONFIG = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 500, "hidden_size": 96,
          "intermediate_size": 200, "num_hidden_layers": 2, "num_attention_heads": 12,
          "num_key_value_heads": 6, "head_dim": 16, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 256, "tie_word_embeddings": True, "eos_token_id": 499}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A checkpoint directory (config.json + model.safetensors) of random weights."""
    path = tmp_path_factory.mktemp("ckpt")
    (path / "config.json").write_text(json.dumps(CONFIG))
    full = load(EngineConfig(str(path / "config.json"), load_format="dummy", seed=4)).model
    save_file({n: t.contiguous() for n, t in WeightMap(full).named_weights()},
              str(path / "model.safetensors"))
    return path


def _bytes(model: torch.nn.Module, sharded: bool) -> int:
    """Bytes of the model's sharded (matrices, q/k/v bias) or replicated (norms) parameters."""
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if (p.spec.dim is not None) == sharded)


@pytest.mark.parametrize("n", [2, 3])
def test_each_rank_holds_its_share_of_the_matrices(model_dir, n):
    config = EngineConfig(str(model_dir), tensor_parallel_size=n)
    whole = load(EngineConfig(str(model_dir))).model
    ranks = [load(config, TPGroup(r, n)).model for r in range(n)]
    total, per_rank = _bytes(whole, True), [_bytes(m, True) for m in ranks]
    assert sum(per_rank) == total
    assert all(b <= 1.05 * total / n for b in per_rank), (per_rank, total)
    assert all(_bytes(m, False) == _bytes(whole, False) for m in ranks)  # the norms
    assert _bytes(whole, False) < 0.02 * total
    assert all(m.lm_head.weight is m.embed_tokens.weight for m in ranks)  # tied, per rank


@pytest.mark.parametrize("n", [2, 3])
def test_every_rank_counts_the_whole_models_bytes(model_dir, n):
    """``full_bytes`` (the weight-update size limit) is the whole model's on every rank, though
    each holds only its shard."""
    whole = load(EngineConfig(str(model_dir))).model
    config = EngineConfig(str(model_dir), tensor_parallel_size=n)
    want = sum(p.numel() * p.element_size() for p in whole.parameters())
    assert full_bytes(whole) == want
    assert [full_bytes(load(config, TPGroup(r, n)).model) for r in range(n)] == [want] * n


def test_rank_loaded_from_a_checkpoint_holds_exactly_its_slices(model_dir):
    whole = WeightMap(load(EngineConfig(str(model_dir))).model)
    mine = WeightMap(load(EngineConfig(str(model_dir), tensor_parallel_size=3),
                          TPGroup(2, 3)).model)
    for name in whole.slots:
        spec = getattr(mine.params[mine.slots[name].param], "spec", None)
        want = whole.view(name)
        if spec is not None and spec.dim is not None:
            lo, hi = spec.span(mine.slots[name].shard or 0)
            want = want.narrow(spec.dim, lo, hi - lo)
        assert torch.equal(mine.view(name), want), name
        assert mine.full_shape(name) == tuple(whole.view(name).shape)


class Recording:
    """A safetensors slice that records what it is asked for."""

    def __init__(self, inner) -> None:
        self.inner, self.asked = inner, []

    def __getitem__(self, index):
        self.asked.append(index)
        return self.inner[index]

    def get_shape(self):
        return self.inner.get_shape()


def test_weight_loader_reads_only_the_ranks_rows_and_columns(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"o": torch.randn(12, 8, generator=g), "q": torch.randn(8 * 4, 6, generator=g),
               "k": torch.randn(2 * 4, 6, generator=g), "v": torch.randn(2 * 4, 6, generator=g)}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    row = RowParallelLinear(8, 12, segments=2, group=TPGroup(1, 2), chains=2)  # columns [4, 8)
    qkv = QKVParallelLinear(6, 4, hq=8, hkv=2, group=TPGroup(1, 2))  # KV group 1's rows
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        o = Recording(f.get_slice("o"))
        row.weight.weight_loader(row.weight, o, None)
        shards = [Recording(f.get_slice(n)) for n in "qkv"]
        for i, s in enumerate(shards):
            qkv.weight.weight_loader(qkv.weight, s, i)
    assert o.asked == [(slice(None), slice(4, 8))]
    assert torch.equal(row.weight, tensors["o"][:, 4:8])
    assert [s.asked for s in shards] == [[(slice(16, 32),)], [(slice(4, 8),)], [(slice(4, 8),)]]
    assert torch.equal(qkv.weight, torch.cat([tensors["q"][16:], tensors["k"][4:],
                                              tensors["v"][4:]]))
