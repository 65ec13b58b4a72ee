"""Tensor-parallel ranks as processes (vLLM's shape): rank 0 is the engine's process -- it schedules,
announces each model call to the other ranks (through a shared-memory ``MessageQueue`` it creates
before spawning them, ``TPGroup.broadcast_object``), runs it on its own shard, and samples; ranks
1..N-1 are spawned processes (``samebits.engine.worker``) that load only their shard, run a runner
of their own and make every call rank 0 announces.

``start_runner(config)`` starts them all: the ranks load at the same time; each reports over a pipe
that it loaded (or why it failed) before any process group exists, so a rank that fails to start is
an error naming it, never a wait. Then the ranks join the process group and build their runners
together. A watcher thread follows the ranks' processes: when one dies (killed, or an exception),
the next call, or the collective rank 0 waits in, raises ``RankFailedError`` naming the rank (gloo
fails a collective whose peer closed its connection; an NCCL group is aborted). Rank 0 stopping
inside a call it announced (an exception or an interrupt of its own) breaks the engine the same
way (``Ranks.guard``): the other ranks are still in that call, and its collectives must never
pair with the next call's. Shutdown
(``Ranks.close``; also when the runner is collected, and at exit) never waits on a collective
teardown, and returns within ``STOP_GRACE_S`` + ``KILL_WAIT_S`` + ``group.RELEASE_TIMEOUT_S`` (25 s;
well under a second when the ranks exit when told): rank 0 destroys its CUDA graphs (an NCCL
communicator cannot be released while a graph that captured its collectives lives), tells the ranks
to stop -- each drops its graphs, waits for its device and exits (``os._exit``) without touching the
process group --, waits for them to exit, kills those that did not, unlinks the queue's shared
memory, then releases its own side of the group alone (``TPGroup.leave``: local, bounded; a release
that hangs is reported and left in a daemon thread). Afterwards this process can start another
tensor-parallel engine. Rank 0 waiting for a queue slot that a dead rank never frees raises that
rank's ``RankFailedError`` once the watcher named it.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import multiprocessing as mp
import socket
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from samebits.config import EngineConfig
from samebits.distributed.group import TPGroup, check_free, run_bounded
from samebits.distributed.message_queue import MessageQueue
from samebits.engine.cuda_graph import DecodeGraphs
from samebits.engine.piecewise_graph import PiecewiseGraphs
from samebits.engine.runner import ModelRunner
from samebits.engine.worker import rank_main
from samebits.loader import LoadedModel, load, rank_device
from samebits.log import get_logger

DEATH_GRACE_S = 5.0  # how long a failed collective waits for the watcher to name a dead rank
STOP_GRACE_S = 10.0  # how long ranks told to stop get to exit before they are killed
KILL_WAIT_S = 5.0  # how long a killed rank's process gets to be gone
log = get_logger("engine")


class RankFailedError(RuntimeError):
    """A tensor-parallel rank's process died or failed; the message names the rank."""


def start_runner(config: EngineConfig, loaded: LoadedModel | None = None) -> ModelRunner:
    """Rank 0's runner; under tensor parallel the other ranks are started first."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(loaded or load(config), config)
    if loaded is not None:
        raise ValueError("tensor_parallel_size > 1 loads each rank's shard itself; do not pass "
                         "a loaded model")
    check_devices(config)
    check_main_guard()
    check_free()  # before any rank is spawned
    ranks = Ranks(config)
    try:
        group = ranks.group = TPGroup(0, config.tensor_parallel_size, rank_device(config, 0))
        group.queue = ranks.queue
        if group.device.type == "cuda":  # as on every rank: its GPU is the current device
            torch.cuda.set_device(group.device)
        start = time.perf_counter()
        loaded = load(config, group)
        ranks.wait_ready()
        log.info("tensor parallel: %d ranks loaded their shards in %.1f s", ranks.world,
                 time.perf_counter() - start)
        ranks.watch()  # from here a rank's death is named, connecting included
        with ranks.guard():
            group.connect(ranks.init_method, config.max_num_batched_tokens,
                          config.batch_invariant, ranks.listener.detach())
            log.info("tensor parallel: process group connected (%s)", group.backend)
            runner = ModelRunner(loaded, config, peers=ranks)
        ranks.serving = True  # every rank built its runner and waits for rank 0's calls
    except BaseException:
        ranks.close()
        raise
    weakref.finalize(runner, ranks.close)
    atexit.register(ranks.close)
    return runner


class Ranks:
    """Rank 0's handle on ranks 1..N-1: their processes, the pipe each reports on, and the
    queue that announces the calls they follow (``ModelRunner.follow``) -- rank r reads it as
    reader r - 1."""

    def __init__(self, config: EngineConfig) -> None:
        self.world = config.tensor_parallel_size
        # rank 0's rendezvous socket, listening before any rank starts (``TPGroup._store``)
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=2 * self.world + 8)
        self.init_method = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.watcher: threading.Thread | None = None
        self.group: TPGroup | None = None  # rank 0's place in the group (``start_runner``)
        self.failure: str | None = None
        self.open_calls = 0  # announced calls rank 0 has not issued every collective of yet
        self.serving = False  # every rank's runner is built; the ranks wait for calls
        self.closing = False
        # rank 0's CUDA graphs, released before the group
        self.graphs: weakref.WeakSet[DecodeGraphs | PiecewiseGraphs] = weakref.WeakSet()
        self.queue = MessageQueue.create(readers=self.world - 1)
        self.queue.check = self._check_failure  # a write waiting on a dead rank raises
        ctx = mp.get_context("spawn")  # CUDA cannot be forked; every platform spawns alike
        self.pipes: dict[int, Connection] = {}
        self.procs: dict[int, mp.Process] = {}
        try:
            for rank in range(1, self.world):
                mine, theirs = ctx.Pipe(duplex=False)
                self.procs[rank] = ctx.Process(
                    target=rank_main, name=f"samebits-tp-rank-{rank}", daemon=True,
                    args=(config, rank, self.init_method, self.queue.handle, theirs,
                          torch.get_num_threads()))
                self.pipes[rank] = mine
            for proc in self.procs.values():
                proc.start()
        except BaseException:
            self.queue.close()
            self.listener.close()
            raise
        log.info("tensor parallel: spawned ranks 1..%d (pids %s)", self.world - 1,
                 ", ".join(str(p.pid) for p in self.procs.values()))

    def wait_ready(self) -> None:
        """Until every rank loaded its shard; ``RankFailedError`` naming the first that failed
        or exited instead."""
        waiting = set(self.procs)
        while waiting:
            handles = {self.pipes[r]: r for r in waiting} | {self.procs[r].sentinel: r
                                                             for r in waiting}
            for handle in wait(list(handles)):
                rank = handles[handle]
                if handle is self.pipes[rank] and self._message(rank) == "ready":
                    waiting.discard(rank)
                elif rank in waiting:
                    raise RankFailedError(self._death(rank, starting=True))

    def _message(self, rank: int) -> str:
        try:
            kind, text = self.pipes[rank].recv()
        except (EOFError, OSError):
            raise RankFailedError(self._death(rank, starting=True)) from None
        if kind == "error":
            raise RankFailedError(f"tensor-parallel rank {rank} failed to start: {text}")
        return kind

    def _death(self, rank: int, starting: bool) -> str:
        proc = self.procs[rank]
        proc.join(DEATH_GRACE_S)
        code = proc.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else \
            f"exited with code {code}"
        text = f"tensor-parallel rank {rank} (pid {proc.pid}) {how}"
        error = self._last_error(rank)
        if error is not None:
            return f"{text}: {error}"
        if starting:
            text += (" before it loaded its shard. Ranks are spawned processes that import the "
                     "main module: a script that starts the engine at module level needs "
                     "`if __name__ == \"__main__\":` around it")
        return text

    def _last_error(self, rank: int) -> str | None:
        """The error a rank reported on its pipe before it exited, if any."""
        pipe, error = self.pipes[rank], None
        with contextlib.suppress(EOFError, OSError):
            while pipe.poll():
                kind, text = pipe.recv()
                error = text if kind == "error" else error
        return error

    def watch(self) -> None:
        """Follow the ranks' processes from a thread: the first to die unasked is recorded and
        the group aborted, so rank 0 never waits for it."""
        self.watcher = threading.Thread(target=self._watch, name="samebits-tp-watcher",
                                        daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        sentinels = {p.sentinel: r for r, p in self.procs.items()}
        ready = wait(list(sentinels))
        if self.closing or self.failure is not None:  # shut down, or broken (``_break``)
            return
        self.failure = self._death(sentinels[ready[0]], starting=False)
        self.group.abort()  # returns once the caller's error released the graphs (``guard``)

    def hold_graphs(self, graphs: DecodeGraphs | PiecewiseGraphs) -> None:
        """One of rank 0's sets of CUDA graphs, destroyed before its side of the group is
        released (held weakly: the runner owns them)."""
        self.graphs.add(graphs)

    def _release_graphs(self) -> None:
        """Destroy rank 0's graphs, wherever they are still referenced (main thread only: no
        replay runs beside it)."""
        for graphs in list(self.graphs):
            graphs.release()

    def check(self) -> None:
        if self.closing:
            raise RuntimeError("the tensor-parallel engine was shut down")
        self._check_failure()

    def _check_failure(self) -> None:
        if self.failure is not None:
            raise RankFailedError(self.failure)

    def announce(self, op: str, *args: Any) -> None:
        self.check()
        self.group.broadcast_object((op, args))

    @contextlib.contextmanager
    def call(self, op: str, *args: Any) -> Iterator[None]:
        """Announce ``op``, then run rank 0's part of it: the call is open -- the other ranks
        are inside it -- until the body returns, having issued the call's last collective. A
        body that raises leaves it open, which breaks the engine (``guard``)."""
        self.open_calls += 1  # first: a write cut short may still have reached a rank
        self.announce(op, *args)
        yield
        self.open_calls -= 1

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """An exception while the ranks work (a collective whose peer died) becomes the dead
        rank's ``RankFailedError`` once the watcher has named it; the engine cannot run again,
        so rank 0's graphs are destroyed then (the watcher's NCCL abort waits for that). A body
        that returns once the watcher has named a dead rank raises it too: after the group's
        abort its results are garbage (``TPGroup.abort`` ends the push barriers). Any other
        exception (a KeyboardInterrupt too) inside an open call (``call``) left the other ranks
        in it, so their collectives would pair with the next call's: the engine is broken
        (``_break``, decided even if a second interrupt cuts the wait for a death short), the
        exception goes on, and every later call raises ``RankFailedError``. One raised after
        its calls closed (rank 0 waiting for a step's tokens) leaves the engine serving."""
        try:
            yield
            self._check_failure()
        except RankFailedError:
            self._release_graphs()
            raise
        except BaseException as e:
            if self.closing:  # the engine was shut down: nothing to name
                raise
            try:
                if isinstance(e, Exception):  # a collective's error: the watcher may name a death
                    self._await_failure()
            finally:
                dead = self.failure is not None
                if not dead and self.open_calls:
                    self._break(f"rank 0 stopped inside a call the other tensor-parallel ranks "
                                f"made ({type(e).__name__}: {e}), so they are out of step; this "
                                f"engine runs no more calls: start a new one")
            if dead:
                self._release_graphs()
                raise RankFailedError(self.failure) from e
            raise

    def _await_failure(self) -> None:
        """Up to ``DEATH_GRACE_S`` for the watcher to name a dead rank."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def _break(self, reason: str) -> None:
        """End an engine whose ranks are out of step: every later call raises ``reason``; the
        ranks, waiting in collectives rank 0 will never make, are killed; the group aborted."""
        self.failure = reason
        log.error("tensor parallel: %s", reason)
        self._release_graphs()
        for proc in self.procs.values():
            proc.kill()
        self.group.abort()

    def close(self) -> None:
        """Stop the ranks and leave the process group (idempotent; see the module docstring).
        Ranks that died, or that are mid-call (a start that failed), are not told: they are
        killed at once."""
        if self.closing:
            return
        self.closing = True
        self._release_graphs()
        group = self.group
        deadline = time.monotonic() + STOP_GRACE_S
        told = (group is not None and group.connected and self.serving and self.failure is None
                and run_bounded(lambda: group.broadcast_object(("stop", ())), STOP_GRACE_S,
                                "telling the ranks to stop")[0])
        clean = self._reap(deadline if told else 0.0)
        if not clean and told:
            log.warning("tensor parallel: a rank did not exit when told to stop; it was killed")
        self.queue.close()
        self._close_handles()
        if group is not None:
            group.leave(synchronize=clean)

    def _close_handles(self) -> None:
        """The pipes, and the exit hook, which kept this object alive until exit (the process
        handles, whose exit codes stay readable, close when it is collected)."""
        for pipe in self.pipes.values():
            pipe.close()
        self.listener.close()  # unless rank 0's store took it
        if self.watcher not in (None, threading.current_thread()):  # woken by the ranks' exit
            self.watcher.join(KILL_WAIT_S)
        atexit.unregister(self.close)

    def _reap(self, deadline: float) -> bool:
        """Wait until ``deadline`` (``time.monotonic``) for the ranks to exit, then kill those
        still running and give them ``KILL_WAIT_S`` in all to be gone; True when every rank
        exited by itself with code 0."""
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        clean = all(p.exitcode == 0 for p in self.procs.values())
        killed = [p for p in self.procs.values() if p.is_alive()]
        for proc in killed:
            proc.kill()
        gone = time.monotonic() + KILL_WAIT_S
        for proc in killed:
            proc.join(max(0.0, gone - time.monotonic()))
        return clean


def check_devices(config: EngineConfig) -> None:
    """Raise, naming them, where the CUDA devices the ranks take (``rank_device``) are not all
    on this machine."""
    if config.torch_device.type != "cuda":
        return
    first, last = (rank_device(config, r).index for r in (0, config.tensor_parallel_size - 1))
    count = torch.cuda.device_count()
    if last >= count:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} with "
                         f"device={config.device!r} runs its ranks on cuda:{first}..cuda:{last}, "
                         f"but this machine has {count} CUDA device(s)")


def check_main_guard() -> None:
    """Raise if the engine is being started by the main script's module-level code outside an
    ``if __name__ == "__main__":`` block: the spawned ranks import the main module, so they
    would start engines of their own (Python's spawn forbids it) instead of loading a shard."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec = getattr(main, "__spec__", None)
    if main is None or path is None or not path.endswith(".py"):
        return  # an interactive session, python -c, or a console script: nothing re-runs
    if spec is not None and spec.name.endswith(".__main__"):
        return  # python -m package: spawn does not import a package's __main__ again
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is vars(main)
                                     and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None or _guarded(path, frame.f_lineno):
        return
    raise RuntimeError(
        f"{path}, line {frame.f_lineno}: tensor_parallel_size > 1 starts the ranks as spawned "
        "processes, which import the main module; put the code that creates the engine under "
        "`if __name__ == \"__main__\":` (as with vLLM and Python's multiprocessing)")


def _guarded(path: str, line: int) -> bool:
    """Whether ``line`` of the script lies inside an ``if __name__ == "__main__":`` block."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return True  # cannot tell: let Python's own check speak
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) and node.body:
            first, last = node.body[0], node.body[-1]
            if first.lineno <= line <= (last.end_lineno or last.lineno):
                return True
    return False


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = {s.id for s in sides if isinstance(s, ast.Name)}
    consts = {s.value for s in sides if isinstance(s, ast.Constant)}
    return names == {"__name__"} and consts == {"__main__"}
