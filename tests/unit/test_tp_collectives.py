"""Tensor-parallel ranks issue the same collectives in the same order, and shutting down never
waits on a collective teardown (CPU, gloo, 2 ranks; each engine in a script of its own, as a
user's).

What they prove: through start-up, a generate call (prefill and decode) and shutdown, rank 0 and
rank 1 record the same sequence of collectives (``SAMEBITS_TP_TRACE``), announcements included,
ending with the stop; told to stop, rank 1 exits by itself with code 0 within seconds without
calling any teardown of the process group (a stand-in records every destroy or abort it would
make), and rank 0 releases its side alone, leaving no default process group behind; so a second
TP 2 engine starts in the same process and returns the first one's tokens bit for bit, and a
process that never shuts that second engine down still exits cleanly (at exit), its rank gone.
Negative controls, each bounded: a rank that does not exit when told is killed (exit code -9),
and a release of rank 0's side that never returns (a stand-in that sleeps, as an NCCL abort
waiting on a live CUDA graph would) is left behind -- shutdown still returns within its bounds,
a second engine then fails at once with an error saying why, and the process still exits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tiny_models import MICRO_LLAMA_CONFIG, write_config

ROOT = Path(__file__).parents[2]
# argv: config path, "clean" | "stuck", a work directory
SCRIPT = '''
import json, os, sys, time
from pathlib import Path
import torch.distributed as dist
from samebits.distributed import group as group_module
from samebits.engine import executor, worker

WORK = Path(sys.argv[3])


def recorded(name, real):  # a teardown rank 1 must never make: noted, then made
    def teardown(*args, **kwargs):
        with open(WORK / "rank-1-teardown.txt", "a") as f:
            f.write(name + "\\n")
        return real(*args, **kwargs)
    return teardown


if __name__ == "__mp_main__":  # the spawned rank imports this script under this name
    dist.destroy_process_group = recorded("destroy", dist.destroy_process_group)
    dist.distributed_c10d._abort_process_group = recorded(
        "abort", dist.distributed_c10d._abort_process_group)
    group_module._release_process_group = recorded("release", group_module._release_process_group)
    if sys.argv[2] == "stuck":  # rank 1 never exits once told to stop
        real_serve = worker.serve
        worker.serve = lambda runner, group: (real_serve(runner, group), time.sleep(600))
if __name__ == "__main__":
    from samebits import LLM, SamplingParams
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    if sys.argv[2] == "stuck":  # rank 0's release never returns
        group_module._release_process_group = lambda device_type: time.sleep(600)
    executor.STOP_GRACE_S, group_module.RELEASE_TIMEOUT_S = 3.0, 1.0
    os.environ["SAMEBITS_TP_TRACE"] = str(WORK / "trace-1")
    llm = LLM(sys.argv[1], load_format="dummy", num_kv_blocks=16, tensor_parallel_size=2)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    rank_1 = llm.engine.runner.peers.procs[1]
    start = time.monotonic()
    llm.engine.runner.shutdown()
    result = {"close_s": time.monotonic() - start, "rank_1_exitcode": rank_1.exitcode,
              "initialized": dist.is_initialized()}
    os.environ["SAMEBITS_TP_TRACE"] = str(WORK / "trace-2")
    start = time.monotonic()
    try:
        second = LLM(sys.argv[1], load_format="dummy", num_kv_blocks=16, tensor_parallel_size=2)
    except RuntimeError as e:
        result |= {"second_error": str(e), "second_error_s": time.monotonic() - start}
    else:  # never shut down: the process's exit stops its rank
        result |= {"same_tokens": first == [o.outputs[0].token_ids
                                            for o in second.generate(prompts, params)],
                   "second_rank_1_pid": second.engine.runner.peers.procs[1].pid}
    print(json.dumps(result), flush=True)
'''


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> str:
    path = write_config(tmp_path_factory.mktemp("collectives"), MICRO_LLAMA_CONFIG)
    return str(path)


def _run(tmp_path: Path, config_path: str, mode: str) -> dict:
    script = tmp_path / "tp_script.py"
    script.write_text(SCRIPT)
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(script), config_path, mode, str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]  # the process exited, and cleanly
    return json.loads(out.stdout.strip().splitlines()[-1])


def _trace(directory: Path, rank: int) -> list[dict]:
    lines = (directory / f"rank-{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not Path(f"/proc/{pid}").exists()


def test_ranks_issue_the_same_collectives_and_exit_without_a_collective_teardown(
        tmp_path, config_path):
    result = _run(tmp_path, config_path, "clean")
    rank_0, rank_1 = _trace(tmp_path / "trace-1", 0), _trace(tmp_path / "trace-1", 1)
    assert rank_0 == rank_1
    ops = [e["op"] for e in rank_0]
    assert ops[:2] == ["all_gather", "min_int"]  # the group's check at connect
    assert {"broadcast_object:forward", "broadcast_object:logits", "all_gather"} <= set(ops)
    assert ops[-1] == "broadcast_object:stop"
    assert result["rank_1_exitcode"] == 0  # it exited by itself: not killed
    assert not (tmp_path / "rank-1-teardown.txt").exists()  # without destroying or aborting
    assert result["close_s"] < 3.0 and not result["initialized"]
    assert result["same_tokens"]  # a second engine in the same process
    assert _trace(tmp_path / "trace-2", 0) == _trace(tmp_path / "trace-2", 1)
    assert _gone(result["second_rank_1_pid"], within=10)  # stopped at the process's exit


def test_shutdown_is_bounded_when_a_rank_never_exits_and_the_release_never_returns(
        tmp_path, config_path):
    result = _run(tmp_path, config_path, "stuck")
    assert result["rank_1_exitcode"] == -9  # killed after the 3 s grace
    assert 3.0 <= result["close_s"] < 3.0 + 5.0 + 1.0 + 2.0  # grace, kill, release bounds
    assert "could not be released" in result["second_error"]
    assert result["second_error_s"] < 1.0  # refused before any rank is spawned
