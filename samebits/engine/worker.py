"""A tensor-parallel rank's process (ranks 1..N-1; rank 0 is the engine's, ``executor``).

It loads only its shard, reports over its pipe that it is ready (or why it failed), joins the
process group, builds its own runner (its own KV cache and CUDA graphs, sized on its own device)
in step with rank 0's, then makes every call rank 0 announces (read from the shared-memory
queue rank 0 created, ``TPGroup.broadcast_object``) until told to stop. Then it destroys
its CUDA graphs, waits for its device (every collective it issued has completed on every rank:
rank 0 issued the same ones before saying stop) and exits with code 0 without touching the
process group: no teardown of NCCL's, which waits for the graphs that captured its collectives
and cannot be trusted to return (rank 0 releases its own side alone, ``TPGroup.leave``; the
communicator's resources go with the process). After an error, or when rank 0's process goes away
(a collective with it fails, or a thread sees it gone), it reports and exits with code 1.
``SAMEBITS_FAULTHANDLER_S`` makes it dump its stacks periodically (``samebits.env``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

import torch

from samebits import env
from samebits.config import EngineConfig
from samebits.distributed.group import TPGroup
from samebits.distributed.message_queue import MessageQueue, QueueHandle
from samebits.engine.runner import ModelRunner
from samebits.loader import load, rank_device
from samebits.log import get_logger

log = get_logger("engine")


def rank_main(config: EngineConfig, rank: int, init_method: str, queue: QueueHandle,
              pipe: Connection, threads: int) -> None:
    """The process's entry point (spawned by ``executor.Ranks``): rank 0's announcements come
    through ``queue``, read as reader ``rank - 1``."""
    torch.set_num_threads(threads)
    _dump_stacks_periodically()
    _exit_with_parent()
    try:
        group = TPGroup(rank, config.tensor_parallel_size, rank_device(config, rank))
        group.queue = MessageQueue.attach(queue, rank - 1)
        if group.device.type == "cuda":  # kernels, graph pools and events use the current one
            torch.cuda.set_device(group.device)
        start = time.perf_counter()
        loaded = load(config, group)
    except BaseException as e:
        pipe.send(("error", f"{type(e).__name__}: {e}"))
        raise
    pipe.send(("ready", None))
    log.info("tensor-parallel rank %d: loaded its shard in %.1f s", rank,
             time.perf_counter() - start)
    try:
        group.connect(init_method, config.max_num_batched_tokens, config.batch_invariant)
        runner = ModelRunner(loaded, config)
        log.info("tensor-parallel rank %d: %d KV blocks, %d decode CUDA graphs, %d piecewise "
                 "buckets; serving", rank, runner.num_blocks,
                 0 if runner.graphs is None else len(runner.graphs.graphs),
                 0 if runner.piecewise is None else len(runner.piecewise.chains))
        serve(runner, group)
        runner.release_graphs()
        if group.device.type == "cuda":
            torch.cuda.synchronize(group.device)
    except BaseException as e:  # noqa: BLE001 -- any failure: report it, then exit now
        with contextlib.suppress(Exception):
            pipe.send(("error", "".join(traceback.format_exception_only(e)).strip()))
        traceback.print_exc()
        _exit_now(1)
    _exit_now(0)


def serve(runner: ModelRunner, group: TPGroup) -> None:
    """Make each call rank 0 announces, in order, until it says stop."""
    while True:
        op, args = group.broadcast_object()
        if op == "stop":
            return
        runner.follow(op, args)


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown (which would tear the process group down)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _dump_stacks_periodically() -> None:
    seconds = env.faulthandler_seconds()
    if seconds is not None:
        faulthandler.enable()
        faulthandler.dump_traceback_later(seconds, repeat=True)


def _exit_with_parent() -> None:
    """Exit as soon as rank 0's process is gone (a killed parent leaves daemons running)."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="samebits-tp-parent", daemon=True).start()
