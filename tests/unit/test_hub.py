"""Hugging Face ids: ``LLM("org/name")`` loads the snapshot the local HF cache holds for revision
``main`` (``download_dir``, or huggingface_hub's cache dir: HF_HUB_CACHE / HF_HOME), bitwise the
same model as its directory; a model that is neither cached nor downloadable is an error naming
the id, the cache folder looked in and the command that fetches it."""

from __future__ import annotations

import shutil

import huggingface_hub
import pytest

from samebits import LLM, SamplingParams
from samebits.config import ModelFormatError
from samebits.loader import resolve_model_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"
PARAMS = SamplingParams(max_tokens=4, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def hub_cache(tiny_llama_dir, tmp_path_factory):
    """A cache as huggingface_hub lays it out: models--org--tiny/{refs/main, snapshots/<sha>}."""
    root = tmp_path_factory.mktemp("hf") / "hub"
    repo = root / "models--org--tiny"
    shutil.copytree(tiny_llama_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return root


@pytest.fixture
def offline_hub(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _bits(llm: LLM) -> tuple:
    out = llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False)[0].outputs[0]
    return out.token_ids, out.token_logprobs


def test_a_cached_hub_id_loads_the_snapshot_bitwise_as_its_directory(hub_cache, tiny_llama_dir,
                                                                      offline_hub, monkeypatch):
    direct = LLM(str(tiny_llama_dir), num_kv_blocks=16)
    by_id = LLM("org/tiny", download_dir=str(hub_cache), num_kv_blocks=16)
    assert by_id.engine.loaded.model_dir == hub_cache / "models--org--tiny" / "snapshots" / COMMIT
    assert _bits(by_id) == _bits(direct) and by_id.fingerprint == direct.fingerprint
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    assert resolve_model_dir("org/tiny") == by_id.engine.loaded.model_dir  # serve's path


@pytest.mark.smoke
def test_a_missing_model_names_the_id_the_cache_folder_and_the_fetch_command(hub_cache,
                                                                            offline_hub):
    with pytest.raises(ModelFormatError) as e:
        LLM("org/missing", download_dir=str(hub_cache))
    message = str(e.value)
    assert "org/missing" in message and str(hub_cache / "models--org--missing") in message
    assert f"hf download org/missing --cache-dir {hub_cache}" in message
    with pytest.raises(ModelFormatError, match="revision v2"):
        LLM("org/tiny", revision="v2", download_dir=str(hub_cache))
