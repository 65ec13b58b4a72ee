"""``LLM.update_weights`` on CUDA keeps the captured decode graphs valid: the weights are copied in
place, so the graphs replayed after an update (no recapture) give bitwise what a fresh engine,
loaded from a checkpoint of the new weights, gives -- token ids and logprobs, greedy and sampled,
in a batch of 16. Negative control: the outputs before the update differ (the graphs do read the
new weights). A prefix cached under the old weights is never reused after the update."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from safetensors.torch import save_file  # noqa: E402

from samebits import LLM, SamplingParams  # noqa: E402

CONFIG = Path(__file__).parents[2] / "benchmarks" / "configs" / "qwen3-tiny.json"
rng = random.Random(1)
PROMPTS = [[rng.randrange(2, 8192) for _ in range(10 + 23 * i)] for i in range(16)]
PARAMS = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True) if i % 2 else
          SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, seed=50 + i, ignore_eos=True)
          for i in range(16)]


def _llm(model: str | Path, **kwargs) -> LLM:
    return LLM(str(model), device="cuda", dtype="bfloat16", seed=0, max_num_seqs=16,
               max_model_len=1024, kv_cache_memory_bytes=1 << 28, **kwargs)


def _run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    return [(o.outputs[0].token_ids, o.outputs[0].token_logprobs)
            for o in llm.generate(PROMPTS, PARAMS)]


def _new_weights(llm: LLM) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(7)
    return {n: (w.float() + 0.01 * torch.randn(w.shape, device="cuda", generator=gen)).to(w.dtype)
            for n, w in llm.named_weights()}


def _checkpoint(weights: dict[str, torch.Tensor], out: Path) -> Path:
    cfg = json.loads(CONFIG.read_text())
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({n: t.detach().contiguous().cpu() for n, t in weights.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_gpu_update_weights_graphs_replay_new_weights_equal_fresh_engine(tmp_path):
    llm = _llm(CONFIG, load_format="dummy")
    graphs = dict(llm.engine.runner.graphs.graphs)
    assert graphs
    before = _run(llm)
    new = _new_weights(llm)
    old_fp = llm.fingerprint
    assert llm.update_weights(new) != old_fp
    after = _run(llm)
    # the very graph objects captured at start replayed the new weights: nothing was recaptured
    assert llm.engine.runner.graphs.graphs.keys() == graphs.keys()
    assert all(llm.engine.runner.graphs.graphs[k] is g for k, g in graphs.items())
    fresh = _llm(_checkpoint(new, tmp_path))
    want = _run(fresh)
    assert [i for i, (a, w) in enumerate(zip(after, want, strict=True)) if a != w] == []
    assert [i for i, (a, b) in enumerate(zip(after, before, strict=True)) if a != b] != []  # moved
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_gpu_update_weights_never_reuses_prefix_blocks_of_old_weights():
    llm = _llm(CONFIG, load_format="dummy")
    prompt = PROMPTS[5]  # 125 tokens: seven full 16-token blocks
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], sp)
    assert llm.generate([prompt], sp)[0].num_cached_tokens == 112  # the cache works
    w = dict(llm.named_weights())["model.norm.weight"]
    llm.update_weights({"model.norm.weight": w * 1.5})
    assert llm.generate([prompt], sp)[0].num_cached_tokens == 0
