"""Tensor-parallel faults end in an error naming the rank, never in a wait (CPU, gloo, 2 ranks).

What they prove: after rank 1 is killed (SIGKILL) the next ``generate`` raises
``RankFailedError`` naming rank 1 and the signal within 30 s, and ``check_health`` raises it too;
a rank whose start fails (an exception while it loads) makes ``LLM(...)`` raise within 30 s with
the rank and its error; a script that would start the engine at module level without an
``if __name__ == "__main__":`` guard gets a clear error (nothing is spawned), a guarded one does
not; and when rank 0's process is killed, the other ranks exit. Rank 0 of a running TP 2 engine
holds about half of the sharded weights.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from samebits import LLM, SamplingParams
from samebits.config import EngineConfig
from samebits.engine import sampler
from samebits.engine.executor import RankFailedError, check_devices, check_main_guard, start_runner
from samebits.loader import rank_device
from tests.tiny_models import MICRO_LLAMA_CONFIG, write_config

ROOT = Path(__file__).parents[2]
FAILING_START = '''
import sys, time
import samebits.engine.worker as worker
from samebits.distributed.group import TPGroup
if __name__ == "__mp_main__":  # the spawned rank imports this script under this name
    def broken(*args, **kwargs):
        raise RuntimeError("{error}")
    if "{where}" == "load":
        worker.load = broken
    else:
        TPGroup.connect = broken
if __name__ == "__main__":
    import datetime
    from samebits import LLM
    from samebits.distributed import group
    group.RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=5)  # what rank 0 waits for a joiner
    start = time.monotonic()
    try:
        LLM(sys.argv[1], load_format="dummy", num_kv_blocks=8, tensor_parallel_size=2)
    except Exception as e:
        print(type(e).__name__, "|", e, "|", time.monotonic() - start)
'''


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> str:
    path = write_config(tmp_path_factory.mktemp("faults"), MICRO_LLAMA_CONFIG)
    return str(path)


def test_killed_rank_raises_naming_it_within_30s(config_path):
    llm = LLM(config_path, load_format="dummy", num_kv_blocks=8, tensor_parallel_size=2)
    try:
        runner = llm.engine.runner
        sharded = sum(p.numel() for p in runner.model.parameters() if p.spec.dim is not None)
        assert sharded == pytest.approx(_sharded_total() / 2, rel=0.05)  # rank 0: its half
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0].outputs[0].token_ids
        os.kill(runner.peers.procs[1].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RankFailedError, match=r"rank 1 \(pid \d+\) was killed by signal 9"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
        assert time.monotonic() - start < 30
        with pytest.raises(RankFailedError, match="rank 1"):
            runner.check_health()
    finally:
        llm.engine.runner.shutdown()


def _interrupt_at_gather(group, n: int):
    """Make rank 0's ``n``-th ``all_gather`` from now raise KeyboardInterrupt (a notebook's
    interrupt reaches rank 0 alone), after rank 1 entered the call."""
    gather, count = group.all_gather, iter(range(1, 10**9))

    def flaky(x):
        if next(count) == n:
            raise KeyboardInterrupt
        return gather(x)
    return flaky


def _interrupting_once(fn):
    """``fn`` whose first call raises KeyboardInterrupt."""
    calls = iter(range(10**9))

    def wrapped(*args, **kwargs):
        if next(calls) == 0:
            raise KeyboardInterrupt
        return fn(*args, **kwargs)
    return wrapped


def test_rank_0_stopping_inside_a_call_breaks_the_engine_instead_of_misaligning_the_ranks(
        config_path, monkeypatch):
    """Rank 0 interrupted between the collectives of a forward leaves rank 1 inside it: the next
    call must raise, never pair its collectives with the stale ones (which returned other
    tokens, silently). Controls: an exception before any call is announced, and an interrupt
    after the step's calls closed (where rank 0 waits for its tokens), leave the engine serving
    the same tokens."""
    llm = LLM(config_path, load_format="dummy", num_kv_blocks=8, tensor_parallel_size=2,
              dtype="float32", device="cpu")  # the gloo path, whose gathers are counted
    params, prompt = SamplingParams(max_tokens=4, temperature=0.0), [[7]]
    try:
        runner = llm.engine.runner
        base = llm.generate(prompt, params)[0].outputs[0].token_ids
        prepare, raised = runner.prepare, []

        def failing_once(batch):
            if not raised:
                raised.append(True)
                raise ValueError("bad input")
            return prepare(batch)
        monkeypatch.setattr(runner, "prepare", failing_once)
        with pytest.raises(ValueError, match="bad input"):
            llm.generate(prompt, params)
        assert llm.generate(prompt, params)[0].outputs[0].token_ids == base  # control
        monkeypatch.setattr(sampler, "start_sample", _interrupting_once(sampler.start_sample))
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompt, params)
        assert llm.generate(prompt, params)[0].outputs[0].token_ids == base  # control
        monkeypatch.setattr(runner.group, "all_gather", _interrupt_at_gather(runner.group, 6))
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompt, params)
        with pytest.raises(RankFailedError, match="rank 0 stopped inside a call.*out of step"):
            llm.generate(prompt, params)
        with pytest.raises(RankFailedError, match="out of step"):
            runner.check_health()
    finally:
        llm.engine.runner.shutdown()


def test_engines_started_and_shut_down_in_turn_leave_no_handles_behind(config_path):
    """Each TP 2 engine's pipe and process handles are closed at shutdown (they stayed open
    until the process exited: 3 more descriptors per engine)."""
    open_fds = []
    for _ in range(3):
        llm = LLM(config_path, load_format="dummy", num_kv_blocks=8, tensor_parallel_size=2,
                  device="cpu")
        llm.engine.runner.shutdown()
        del llm
        gc.collect()
        open_fds.append(len(os.listdir("/proc/self/fd")))
    assert open_fds[2] == open_fds[1], open_fds  # the first engine's may start shared pools


def test_ranks_take_consecutive_gpus_from_the_configured_one_and_missing_ones_are_named(
        monkeypatch):
    config = EngineConfig("unused", device="cuda:2", tensor_parallel_size=2)
    assert [rank_device(config, r) for r in (0, 1)] == [torch.device("cuda", 2),
                                                        torch.device("cuda", 3)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with pytest.raises(ValueError, match=r"cuda:2\.\.cuda:3, but this machine has 3 CUDA"):
        start_runner(config)
    check_devices(EngineConfig("unused", device="cuda:1", tensor_parallel_size=2))  # fits


def _sharded_total() -> int:
    """Elements of the config's matrices (and nothing replicated): embedding + LM head, q/k/v,
    o, gate/up, down."""
    h, i, v, d = 32, 48, 64, 8
    return 2 * v * h + (4 + 2 + 2) * d * h + 4 * d * h + 2 * i * h + i * h


def _failing_start(config_path: str, tmp_path: Path, where: str, error: str) -> list[str]:
    """Start a TP 2 engine whose rank 1 raises ``error`` in ``where`` (its load, or joining
    the process group): [the error's type, its message, seconds until it was raised]."""
    script = tmp_path / f"failing_{where}.py"
    script.write_text(FAILING_START.replace("{where}", where).replace("{error}", error))
    out = subprocess.run([sys.executable, str(script), config_path], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env=_env())
    return out.stdout.strip().split(" | ")


def test_rank_failing_at_start_raises_naming_it_within_30s(config_path, tmp_path):
    kind, message, seconds = _failing_start(config_path, tmp_path, "load",
                                            "shard file unreadable")
    assert kind == "RankFailedError"
    assert message == "tensor-parallel rank 1 failed to start: RuntimeError: shard file unreadable"
    assert float(seconds) < 30


def test_rank_failing_to_join_the_group_raises_naming_it_within_30s(config_path, tmp_path):
    """Rank 0 waits in the rendezvous for a rank that died there: named once the rendezvous
    wait (5 s here, ``RENDEZVOUS_TIMEOUT``) ends, not after the collectives' 30 minutes."""
    kind, message, seconds = _failing_start(config_path, tmp_path, "connect",
                                            "no route to the other ranks")
    assert kind == "RankFailedError"
    assert re.fullmatch(r"tensor-parallel rank 1 \(pid \d+\) exited with code 1: "
                        r"RuntimeError: no route to the other ranks", message), message
    assert float(seconds) < 30


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}


def _run_as_main(path: Path, source: str, monkeypatch) -> None:
    """Execute ``source`` as the ``__main__`` script ``path`` (as ``python path`` would)."""
    path.write_text(source)
    main = types.ModuleType("__main__")
    main.__file__ = str(path)
    main.check_main_guard = check_main_guard
    monkeypatch.setitem(sys.modules, "__main__", main)
    exec(compile(source, str(path), "exec"), vars(main))  # noqa: S102


def test_unguarded_main_script_gets_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match=r'line 2: .*`if __name__ == "__main__":`'):
        _run_as_main(tmp_path / "unguarded.py", "import sys\ncheck_main_guard()\n", monkeypatch)
    _run_as_main(tmp_path / "guarded.py",
                 'import sys\nif __name__ == "__main__":\n    check_main_guard()\n', monkeypatch)


@pytest.mark.slow
def test_other_ranks_exit_when_rank_0_is_killed(config_path, tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(
        "import sys, time\nfrom samebits import LLM\n"
        "if __name__ == '__main__':\n"
        "    llm = LLM(sys.argv[1], load_format='dummy', num_kv_blocks=8, tensor_parallel_size=2)\n"
        "    print(llm.engine.runner.peers.procs[1].pid, flush=True)\n"
        "    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script), config_path], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env=_env())
    worker = int(proc.stdout.readline())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(worker):
        time.sleep(0.2)
    assert not _alive(worker)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}").exists() \
        else "X"
    return state not in ("Z", "X")
