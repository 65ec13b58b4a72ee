"""Tensor-parallel ranks issue the same collectives in the same order, and leave the process
group together (CPU, gloo, 2 ranks; each engine in a script of its own, as a user's).

What they prove: through start-up, a generate call (prefill and decode) and shutdown, rank 0 and
rank 1 record the same sequence of collectives (``SAMEBITS_TP_TRACE``), announcements included;
at shutdown rank 0 closes the group while rank 1 closes it (NCCL's finalize and destroy are
collective over the node's ranks: a stand-in here makes gloo's close wait for every rank with a
barrier, which plain gloo does not), so rank 1 exits by itself within seconds instead of being
killed after rank 0 waited for it; and a rank that never closes is killed and rank 0's shutdown
still returns within its close timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
          "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64}
# argv: config path, "together" | "rank-1-never-closes"
SCRIPT = '''
import json, sys, time
import torch.distributed as dist
from samebits.distributed import group as group_module

real_destroy = group_module._destroy_process_group


def collective_destroy():  # NCCL's close waits for every rank of the node: so does this one
    dist.barrier()
    real_destroy()


group_module._destroy_process_group = collective_destroy
if __name__ == "__mp_main__" and sys.argv[2] == "rank-1-never-closes":
    group_module.TPGroup.close = lambda self, timeout=None: time.sleep(600)
if __name__ == "__main__":
    from samebits import LLM, SamplingParams
    group_module.CLOSE_TIMEOUT_S = 2.0
    llm = LLM(sys.argv[1], load_format="dummy", num_kv_blocks=16, tensor_parallel_size=2)
    llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True))
    rank_1 = llm.engine.runner.peers.procs[1]
    start = time.monotonic()
    llm.engine.runner.shutdown()
    print(json.dumps({"close_s": time.monotonic() - start, "rank_1_exitcode": rank_1.exitcode,
                      "connected": dist.is_initialized()}))
'''


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("collectives") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return str(path)


def _run(tmp_path: Path, config_path: str, mode: str) -> dict:
    script = tmp_path / "tp_script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "SAMEBITS_TP_TRACE": str(tmp_path / "trace"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(script), config_path, mode], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _trace(tmp_path: Path, rank: int) -> list[dict]:
    lines = (tmp_path / "trace" / f"rank-{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_ranks_issue_the_same_collectives_and_close_the_group_together(tmp_path, config_path):
    result = _run(tmp_path, config_path, "together")
    rank_0, rank_1 = _trace(tmp_path, 0), _trace(tmp_path, 1)
    assert rank_0 == rank_1
    ops = [e["op"] for e in rank_0]
    assert ops[:2] == ["all_gather", "min_int"]  # the group's check at connect
    assert {"broadcast_object:forward", "broadcast_object:logits", "all_gather"} <= set(ops)
    assert ops[-1] == "broadcast_object:stop"
    assert result["rank_1_exitcode"] == 0  # it closed with rank 0 and exited: not killed
    assert result["close_s"] < 5 and not result["connected"]


def test_shutdown_returns_when_a_rank_never_closes(tmp_path, config_path):
    result = _run(tmp_path, config_path, "rank-1-never-closes")
    assert result["rank_1_exitcode"] == -9  # killed
    assert result["close_s"] < 2.0 + 10 and not result["connected"]
