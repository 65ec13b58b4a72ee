"""A tensor-parallel rank's process (ranks 1..N-1; rank 0 is the engine's, ``executor``).

It loads only its shard, reports over its pipe that it is ready (or why it failed), joins the
process group, builds its own runner (its own KV cache and CUDA graphs, sized on its own device)
in step with rank 0's, then makes every call rank 0 announces until told to stop. It exits when
rank 0's process goes away (a collective with it fails, or a thread sees it gone).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import traceback
from multiprocessing.connection import Connection

import torch

from samebits.config import EngineConfig
from samebits.distributed.group import TPGroup
from samebits.engine.runner import ModelRunner
from samebits.loader import load, rank_device


def rank_main(config: EngineConfig, rank: int, init_method: str, pipe: Connection,
              threads: int) -> None:
    """The process's entry point (spawned by ``executor.Ranks``)."""
    torch.set_num_threads(threads)
    _exit_with_parent()
    try:
        group = TPGroup(rank, config.tensor_parallel_size, rank_device(config, rank))
        if group.device.type == "cuda":  # kernels, graph pools and events use the current one
            torch.cuda.set_device(group.device)
        loaded = load(config, group)
    except BaseException as e:
        pipe.send(("error", f"{type(e).__name__}: {e}"))
        raise
    pipe.send(("ready", None))
    try:
        group.connect(init_method)
        serve(ModelRunner(loaded, config), group)
    except BaseException as e:
        pipe.send(("error", "".join(traceback.format_exception_only(e)).strip()))
        raise
    finally:
        group.close()


def serve(runner: ModelRunner, group: TPGroup) -> None:
    """Make each call rank 0 announces, in order, until it says stop."""
    while True:
        op, args = group.broadcast_object()
        if op == "stop":
            return
        runner.follow(op, args)


def _exit_with_parent() -> None:
    """Exit as soon as rank 0's process is gone (a killed parent leaves daemons running)."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="samebits-tp-parent", daemon=True).start()
