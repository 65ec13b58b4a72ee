"""Bad input gets a clear one-line error naming what is wrong, and the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest

from samebits import LLM, SamplingParams
from samebits.cli import main as cli_main
from samebits.config import ModelFormatError
from samebits.loader import resolve_model_dir

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 64, "eos_token_id": 1}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


def _one_line(err: Exception, must_contain: str) -> None:
    msg = str(err)
    assert "\n" not in msg and must_contain in msg


def test_missing_path_names_the_path(tmp_path):
    with pytest.raises(ModelFormatError) as e:
        LLM(str(tmp_path / "nope"))
    _one_line(e.value, "nope")


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ModelFormatError) as e:
        LLM(str(tmp_path))
    _one_line(e.value, "config.json")


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "architectures": ["GPT2Model"]}))
    with pytest.raises(ModelFormatError) as e:
        LLM(str(tmp_path))
    _one_line(e.value, "GPT2Model")


def test_truncated_safetensors_names_the_file(tmp_path):
    src = resolve_model_dir(None)
    shutil.copy(src / "config.json", tmp_path / "config.json")
    with open(src / "model.safetensors", "rb") as f:
        (tmp_path / "model.safetensors").write_bytes(f.read(1 << 20))
    with pytest.raises(ModelFormatError) as e:
        LLM(str(tmp_path))
    _one_line(e.value, "model.safetensors")


def test_unparsable_tokenizer_names_the_file(tmp_path):
    src = resolve_model_dir(None)
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (tmp_path / name).symlink_to(src / name)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFormatError) as e:
        LLM(str(tmp_path))
    _one_line(e.value, "tokenizer.json")


def test_cli_reports_one_line_and_exit_code_2(tmp_path, capsys):
    assert cli_main(["generate", "hi", "--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "missing" in err


@pytest.mark.parametrize("field,kwargs", [
    ("max_tokens", {"max_tokens": 0}), ("max_tokens", {"max_tokens": -3}),
    ("top_p", {"top_p": 0.0}), ("top_p", {"top_p": 1.5}),
    ("temperature", {"temperature": -0.1}),
])
def test_bad_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_empty_and_too_long_prompts_are_rejected_and_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams(max_tokens=4))
    too_long = [5] * llm.engine.max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["fine prompt", too_long], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished() and llm.engine.kv.pool.num_used == 0
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_dummy_model_from_config_json_runs_on_token_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    tiny = LLM(str(tmp_path / "config.json"), load_format="dummy")
    out = tiny.generate([[3, 4, 5]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="token ids"):
        tiny.generate([[3, 999]], SamplingParams(max_tokens=2))
