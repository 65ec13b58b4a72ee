"""Embeddings against the reference implementations on the same weights (float32, CPU).

- all-MiniLM-L6-v2, 50 sentences: cosine >= 0.99999 against sentence-transformers (when installed:
  the test extra pins it) and against transformers' BertModel + mean pooling + L2 normalisation
  (always), in both numerics modes: invariance must not cost accuracy.
- every pooling mode (mean, CLS, last token; with and without Normalize) on a small random-weight
  BertModel saved by transformers itself, read through modules.json / 1_Pooling/config.json.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from samebits import LLM  # noqa: E402
from samebits.loader.pooling import default_model_dir  # noqa: E402
from samebits.models.pooler import PoolerConfig  # noqa: E402

COS_MIN = 0.99999
SUBJECTS = ["The cat", "A young engineer", "Our server", "This tiny model", "The river",
            "Every batch", "Le chat", "Der Zug", "The 42nd request", "An old library"]
PREDICATES = ["sleeps on the warm windowsill.", "returns the same bits at any batch size!",
              "was flooded after three days of rain; nobody expected it.",
              "computes embeddings for retrieval-augmented generation (RAG).",
              "est arrivé en retard, encore une fois."]
SENTENCES = [f"{s} {p}" for s in SUBJECTS for p in PREDICATES]  # 50


def _cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.double(), b.double(), dim=1)


@pytest.fixture(scope="module")
def hf_reference() -> torch.Tensor:
    """transformers' BertModel (eager attention), masked mean pooling, F.normalize."""
    tok = transformers.AutoTokenizer.from_pretrained(default_model_dir())
    model = transformers.AutoModel.from_pretrained(default_model_dir(), dtype=torch.float32,
                                                   attn_implementation="eager").eval()
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1)


@pytest.mark.parametrize("invariant", [True, False])
def test_minilm_matches_sentence_transformers(invariant, hf_reference):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(default_model_dir()), device="cpu")
    want = model.encode(SENTENCES, batch_size=16, convert_to_tensor=True).float()
    llm = LLM(task="embed", batch_invariant=invariant)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(SENTENCES)])
    assert len(SENTENCES) == 50 and _cosines(got, want).min() >= COS_MIN
    assert _cosines(hf_reference, want).min() >= COS_MIN


@pytest.mark.parametrize("invariant", [True, False])
def test_minilm_matches_transformers_mean_pooling(invariant, hf_reference):
    llm = LLM(task="embed", batch_invariant=invariant)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(SENTENCES)])
    assert _cosines(got, hf_reference).min() >= COS_MIN
    assert (got - hf_reference).abs().max() < 1e-5


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    cfg = transformers.BertConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  max_position_embeddings=96)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg, add_pooling_layer=True).eval()
    path = tmp_path_factory.mktemp("tiny_bert")
    model.save_pretrained(path)
    return model, path


def _pooled(model, ids: list[list[int]], mode: str, normalize: bool) -> torch.Tensor:
    out = []
    for seq in ids:  # one at a time: no padding in the reference
        with torch.no_grad():
            h = model(torch.tensor([seq])).last_hidden_state[0]
        out.append({"mean": h.mean(0), "cls": h[0], "lasttoken": h[-1]}[mode])
    v = torch.stack(out)
    return F.normalize(v, dim=1) if normalize else v


@pytest.mark.parametrize("mode", ["mean", "cls", "lasttoken"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooling_modes_on_a_small_bert(tiny_bert, mode, normalize):
    model, path = tiny_bert
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    flags = {f"pooling_mode_{m}": m == mode.replace("cls", "cls_token").replace("mean", "mean_tokens")
             for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                **flags}))
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (1, 5, 17, 40, 96)]
    want = _pooled(model, ids, mode, normalize)
    for invariant in (True, False):
        emb = LLM(str(path), task="embed", batch_invariant=invariant)
        assert emb.engine.loaded.pooler == PoolerConfig(mode, normalize)
        got = torch.tensor([o.outputs.embedding for o in emb.embed(ids)])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_texts_past_max_seq_length_truncate_as_sentence_transformers():
    """sentence_bert_config.json's max_seq_length (256) is the limit: longer texts are a
    ValueError unless truncation is asked for, and then match sentence-transformers, which
    truncates them to 256 tokens ([CLS] ... [SEP])."""
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(default_model_dir()), device="cpu")
    long = [" ".join(SENTENCES[i:i + 20]) for i in range(0, 40, 10)]  # 260-340 tokens each
    long.append(" ".join(SENTENCES))  # ~680 tokens
    emb = LLM(task="embed")
    lens = [len(emb.get_tokenizer().encode(t)) for t in long]
    assert model.max_seq_length == emb.engine.max_model_len == 256 and min(lens) > 256, lens
    with pytest.raises(ValueError, match="limit of 256 tokens"):
        emb.embed(long)
    want = model.encode(long, convert_to_tensor=True).float()
    got = torch.tensor([o.outputs.embedding for o in emb.embed(long, truncate=True)])
    assert _cosines(got, want).min() >= COS_MIN
