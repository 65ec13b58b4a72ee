"""HF-format directories: single and sharded safetensors load the same weights; dummy weights are
seeded; the fingerprint tracks weights, dtype and numerics mode."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from samebits import LLM  # noqa: E402

CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).eval()
    single, sharded = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("sharded")
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="50KB")
    return single, sharded


def test_sharded_checkpoint_loads_bitwise_like_single_file(saved):
    single, sharded = saved
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    ids = list(range(1, 40))
    a = LLM(str(single)).engine.prompt_logits(ids)
    b = LLM(str(sharded)).engine.prompt_logits(ids)
    assert torch.equal(a, b)


@pytest.mark.smoke
def test_sharded_index_pointing_at_missing_shard_names_it(saved, tmp_path):
    _, sharded = saved
    for f in sharded.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    victim = sorted(tmp_path.glob("*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(ValueError, match=victim.name):
        LLM(str(tmp_path))


def test_dummy_weights_are_seeded_and_fingerprinted(saved):
    single, _ = saved
    cfg = str(single / "config.json")
    a, b = LLM(cfg, load_format="dummy", seed=3), LLM(cfg, load_format="dummy", seed=3)
    c = LLM(cfg, load_format="dummy", seed=4)
    ids = [5, 6, 7]
    assert torch.equal(a.engine.prompt_logits(ids), b.engine.prompt_logits(ids))
    assert a.fingerprint == b.fingerprint != c.fingerprint


def test_fingerprint_depends_on_numerics_mode_and_dtype(saved):
    single, _ = saved
    fps = {LLM(str(single)).fingerprint, LLM(str(single), batch_invariant=False).fingerprint,
           LLM(str(single), dtype="bfloat16").fingerprint}
    assert len(fps) == 3
