"""vLLM's ``LLM`` options and pooling calls: each honoured or refused by name. ``tokenizer=``
replaces the model's tokenizer; ``quantization`` takes None or "gguf" and names them otherwise;
``trust_remote_code`` is accepted and says once that no checkpoint code runs, as are the options
that tune vLLM's machinery without touching the output (``disable_log_stats``...); an unknown
option is an error naming it; ``embed`` / ``encode`` return vLLM's objects, also from a generation ``LLM``
built with a decoder embedding model (bitwise ``LLM(task="embed")``'s vectors), and a generation
model without pooling config gets an error naming the fix."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from samebits import LLM, SamplingParams
from samebits.outputs import EmbeddingRequestOutput, PoolingRequestOutput
from tests.conftest import TINY_LLAMA
from tests.st_files import write_st_files

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("options") / "config.json"
    path.write_text(json.dumps({**TINY_LLAMA, "architectures": ["LlamaForCausalLM"]}))
    return str(path)


@pytest.fixture(scope="module")
def word_tokenizer_dir(tmp_path_factory):
    """A word-level tokenizer of 256 ids (the tiny model's vocabulary), EOS "</s>" = 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, 256)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return path


def test_unknown_options_and_quantizations_are_refused_by_name(config_file):
    with pytest.raises(TypeError, match="'enable_lora'"):
        LLM(config_file, load_format="dummy", enable_lora=True)
    with pytest.raises(ValueError, match="quantization='awq'.*None and 'gguf'"):
        LLM(config_file, load_format="dummy", quantization="awq")
    with pytest.raises(ValueError, match="quantization='gguf'"):
        LLM(config_file, load_format="dummy", quantization="gguf")  # not a .gguf file
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(config_file, load_format="dummy", gpu_memory_utilization=1.5)


def test_trust_remote_code_is_accepted_and_says_no_code_runs_once(config_file, caplog,
                                                                  monkeypatch):
    import samebits.llm_options
    monkeypatch.setattr(samebits.llm_options, "_said_no_remote_code", False)
    with caplog.at_level(logging.INFO, logger="samebits"):
        for _ in range(2):
            LLM(config_file, load_format="dummy", num_kv_blocks=8, trust_remote_code=True)
    said = [r for r in caplog.records if "trust_remote_code" in r.getMessage()]
    assert len(said) == 1 and "never runs code from a checkpoint" in said[0].getMessage()


def test_options_of_vllms_machinery_are_accepted_and_each_said_once(config_file, caplog,
                                                                     monkeypatch):
    """What RL frameworks pass to vLLM's LLM() and that changes no output here: accepted, each
    logged once with the reason; the engine is the one built without them."""
    import samebits.llm_options
    monkeypatch.setattr(samebits.llm_options, "_said_no_effect", set())
    given = dict(disable_log_stats=True, swap_space=4, enable_chunked_prefill=True,
                 disable_custom_all_reduce=True, enable_expert_parallel=True)
    with caplog.at_level(logging.INFO, logger="samebits"):
        for _ in range(2):
            llm = LLM(config_file, load_format="dummy", num_kv_blocks=8, **given)
    said = [r.getMessage() for r in caplog.records if "changes nothing" in r.getMessage()]
    assert sorted(m.split()[0] for m in said) == sorted(given)
    assert llm.config == LLM(config_file, load_format="dummy", num_kv_blocks=8).config


def test_chunked_prefill_off_is_refused_where_chunking_can_change_the_bits(config_file):
    """Standard mode: a prompt's chunking may change its bits, and samebits always chunks, so
    ``enable_chunked_prefill=False`` would be silently ignored: refused, naming it. The invariant
    mode takes it (chunk boundaries never change the bits there)."""
    with pytest.raises(ValueError, match="enable_chunked_prefill=False"):
        LLM(config_file, load_format="dummy", num_kv_blocks=8, batch_invariant=False,
            enable_chunked_prefill=False)
    llm = LLM(config_file, load_format="dummy", num_kv_blocks=8, enable_chunked_prefill=False)
    assert llm.config.batch_invariant


def test_tokenizer_option_replaces_the_models_tokenizer(config_file, word_tokenizer_dir):
    llm = LLM(config_file, load_format="dummy", num_kv_blocks=8,
              tokenizer=str(word_tokenizer_dir))
    tok = llm.get_tokenizer()
    assert tok.encode("w5 w7") == [5, 7] and tok.eos_token_id == 1 and len(tok) == 256
    out = llm.generate("w5 w7", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == [5, 7]
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)


def test_embed_from_a_generation_llm_needs_an_embedding_model_and_names_the_fix(config_file):
    llm = LLM(config_file, load_format="dummy", num_kv_blocks=8)
    with pytest.raises(ValueError, match="task='embed'"):
        llm.embed([[1, 2, 3]])


def test_a_generation_llm_of_a_decoder_embedding_model_embeds_as_task_embed(tmp_path):
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).eval().save_pretrained(tmp_path)
    write_st_files(tmp_path, 64, "lasttoken")
    inputs = [[1, 2, 3], list(range(5, 60)), [9]]
    generating = LLM(str(tmp_path), num_kv_blocks=16)
    got = generating.embed(inputs)
    want = LLM(str(tmp_path), task="embed", num_kv_blocks=16).embed(inputs)
    assert all(isinstance(o, EmbeddingRequestOutput) for o in got)
    assert [o.outputs.embedding for o in got] == [o.outputs.embedding for o in want]
    assert [o.prompt_token_ids for o in got] == inputs
    pooled = generating.encode(inputs)
    assert all(isinstance(o, PoolingRequestOutput) for o in pooled)
    assert [o.outputs.data.tolist() for o in pooled] == [o.outputs.embedding for o in got]
    assert generating.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_params"):
        generating.encode(inputs, pooling_params=object())


def test_model_may_be_a_pathlib_path_and_anything_else_is_refused(config_file):
    from pathlib import Path

    from samebits.config import EngineConfig
    llm = LLM(Path(config_file), load_format="dummy")
    assert llm.engine.config.model == config_file
    with pytest.raises(ValueError, match="model must be a path or a name"):
        EngineConfig(model=3)


def test_an_interrupted_generate_leaves_no_request_behind(config_file, monkeypatch):
    """A generate (or score) stopped by an exception or Ctrl-C aborts its own requests: the
    engine holds none of them, and the next call returns what it would have returned."""
    llm = LLM(config_file, load_format="dummy", num_kv_blocks=32)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10]]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    step, steps = llm.engine.step, iter(range(10**9))

    def interrupted_at_the_third_step():
        if next(steps) == 2:
            raise KeyboardInterrupt
        return step()
    monkeypatch.setattr(llm.engine, "step", interrupted_at_the_third_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params)
    assert not llm.engine.requests and not llm.engine.has_unfinished()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
