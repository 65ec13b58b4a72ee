"""Qwen3-Embedding-style models: last-token pooling of the decoder, L2-normalised, bitwise the
same alone and in any batch -- the inputs of one call prefilled together, in fewer engine steps
than inputs, and chunked -- with the standard mode as negative control; equal (to fp32 rounding)
to transformers' last hidden state."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from samebits import LLM  # noqa: E402
from samebits.pooling_params import PoolingParams  # noqa: E402
from samebits.sampling_params import SamplingParams  # noqa: E402
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


@pytest.fixture(scope="module")
def emb(qwen3_embedding_dir) -> LLM:
    return LLM(str(qwen3_embedding_dir[0]), task="embed", num_kv_blocks=64)


def _vecs(llm: LLM, inputs) -> list[list[float]]:
    """The vectors of ``llm.embed(inputs)``, in input order."""
    return [o.outputs.embedding for o in llm.embed(inputs)]


def _inputs() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, 512, (n,), generator=gen).tolist() for n in (3, 40, 17, 300, 9, 120)]


def test_last_token_embedding_matches_transformers(qwen3_embedding_dir, emb):
    _, model = qwen3_embedding_dir
    for ids, got in zip(_inputs(), _vecs(emb, _inputs()), strict=True):
        with torch.no_grad():
            h = model.model(torch.tensor([ids])).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(h, dim=-1)
        assert torch.nn.functional.cosine_similarity(torch.tensor(got), want, dim=0) > 0.99999


def _steps(llm: LLM, monkeypatch) -> list[int]:
    """The number of sequences in each step the engine's runner runs from now on."""
    sizes, run = [], llm.engine.runner.run

    def counting(batch):
        sizes.append(len(batch.seqs))
        return run(batch)
    monkeypatch.setattr(llm.engine.runner, "run", counting)
    return sizes


def _alone_and_together(llm: LLM, monkeypatch) -> tuple[list, list, list[int]]:
    inputs = _inputs()
    alone = [_vecs(llm, [ids])[0] for ids in inputs]
    sizes = _steps(llm, monkeypatch)
    return alone, _vecs(llm, inputs), sizes


def test_decoder_embedding_bitwise_equal_alone_and_batched(emb, monkeypatch):
    alone, together, sizes = _alone_and_together(emb, monkeypatch)
    assert sizes == [6]  # the six inputs (489 tokens) prefilled in one step
    assert together == alone
    assert _vecs(emb, _inputs()[::-1]) == alone[::-1]


def test_decoder_embedding_chunked_prefill_equals_alone(qwen3_embedding_dir, emb, monkeypatch):
    chunked = LLM(str(qwen3_embedding_dir[0]), task="embed", num_kv_blocks=64,
                  max_num_batched_tokens=64)  # the 300-token input in 5 chunks
    alone = [_vecs(emb, [ids])[0] for ids in _inputs()]
    assert [_vecs(chunked, [ids])[0] for ids in _inputs()] == alone
    sizes = _steps(chunked, monkeypatch)
    assert _vecs(chunked, _inputs()) == alone and len(sizes) == 8  # 489 tokens, 64 per step


def test_negative_control_standard_decoder_batched_changes_bits(qwen3_embedding_dir, monkeypatch):
    path, _ = qwen3_embedding_dir
    std = LLM(str(path), task="embed", batch_invariant=False, num_kv_blocks=64)
    alone, together, sizes = _alone_and_together(std, monkeypatch)
    assert sizes == [6]
    assert together != alone, "stock ops never changed a bit: the test proves nothing"


def test_engines_take_only_their_kind_of_request(qwen3_embedding_dir, emb):
    with pytest.raises(ValueError, match="PoolingParams"):
        emb.engine.add_request("r", [1, 2, 3], SamplingParams())
    gen = LLM(str(qwen3_embedding_dir[0]), num_kv_blocks=64)
    with pytest.raises(ValueError, match="embedding model"):
        gen.engine.add_request("r", [1, 2, 3], PoolingParams())
    with pytest.raises(ValueError, match="task='embed'"):
        emb.generate([1, 2, 3])
