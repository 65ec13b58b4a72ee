"""Qwen3-Embedding-style models: last-token pooling of the decoder, L2-normalised, bitwise the
same alone and in any batch, and equal (to fp32 rounding) to transformers' last hidden state."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from samebits import LLM  # noqa: E402
from tests.st_files import write_st_files  # noqa: E402


@pytest.fixture(scope="module")
def qwen3_embedding_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-emb")
    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(path)
    write_st_files(path, 128, "lasttoken")
    return path, model


def _inputs() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, 512, (n,), generator=gen).tolist() for n in (3, 40, 17, 300, 9, 120)]


def test_last_token_embedding_matches_transformers(qwen3_embedding_dir):
    path, model = qwen3_embedding_dir
    emb = LLM(str(path), task="embed")
    for ids, got in zip(_inputs(), [o.outputs.embedding for o in emb.embed(_inputs())], strict=True):
        with torch.no_grad():
            h = model.model(torch.tensor([ids])).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(h, dim=-1)
        assert torch.nn.functional.cosine_similarity(torch.tensor(got), want, dim=0) > 0.99999


def test_decoder_embedding_bitwise_equal_alone_and_in_any_batch(qwen3_embedding_dir):
    # Each input runs through the decoder on its own, so no stock-op control can differ here;
    # this guards the plumbing (order, pooling row) of the batched call.
    path, _ = qwen3_embedding_dir
    emb = LLM(str(path), task="embed")
    inputs = _inputs()
    alone = [emb.embed([ids])[0].outputs.embedding for ids in inputs]
    assert [o.outputs.embedding for o in emb.embed(inputs)] == alone
    assert [o.outputs.embedding for o in emb.embed(inputs[::-1])] == alone[::-1]
