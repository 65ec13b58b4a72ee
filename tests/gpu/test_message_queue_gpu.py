"""Announcements through the shared-memory queue on two GPUs (NCCL); skipped without 2 CUDA
devices.

What they prove: rank 0 no longer waits for the other ranks when it announces a call, so a rank
killed in the middle of a decode run leaves rank 0 inside NCCL collectives and CUDA graph replays
(not in a gloo broadcast that fails at once): ``generate`` still raises ``RankFailedError`` naming
the rank within 30 s of the kill (the watcher aborts the NCCL group), and shutdown leaves the
queue's shared memory unlinked.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

from samebits import LLM, SamplingParams  # noqa: E402
from samebits.engine.executor import RankFailedError  # noqa: E402

TINY = str(Path(__file__).parents[2] / "benchmarks" / "configs" / "qwen3-tiny.json")
OPTIONS = dict(load_format="dummy", device="cuda", dtype="bfloat16", seed=0, max_num_seqs=8,
               kv_cache_memory_bytes=1 << 28)


def test_rank_killed_mid_decode_raises_naming_it_within_30s_and_unlinks_the_queue():
    llm = LLM(TINY, tensor_parallel_size=2, **OPTIONS)
    peers = llm.engine.runner.peers
    name = Path("/dev/shm") / peers.queue.handle.name
    try:
        assert name.exists()
        llm.generate([[1, 2, 3]] * 8, SamplingParams(max_tokens=8))  # compiled, graphs warm
        killed: list[float] = []

        def kill() -> None:
            killed.append(time.monotonic())
            os.kill(peers.procs[1].pid, signal.SIGKILL)

        timer = threading.Timer(0.5, kill)  # decode steps run by then (3,000 of them in all)
        timer.start()
        with pytest.raises(RankFailedError, match=r"rank 1 \(pid \d+\) was killed by signal 9"):
            llm.generate([[1, 2, 3]] * 8, SamplingParams(max_tokens=3000, ignore_eos=True))
        timer.join()
        assert time.monotonic() - killed[0] < 30
    finally:
        llm.engine.runner.shutdown()
    assert not name.exists()
