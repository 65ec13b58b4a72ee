"""The engine core in a process of its own (vLLM v1's shape), so that the engine's busy loop and
the HTTP server's event loop never wait for each other's GIL.

``EngineProcess(config)`` spawns the process, which builds the ``LLMEngine`` and answers with what
the HTTP side needs of it (``EngineInfo``: config, fingerprint, context length, KV blocks, the
tokenizer); the handle exposes those as attributes, so the app reads them as it would read an
``LLMEngine``'s. ``start`` begins the core's loop (samebits.server.engine_core) and a reader
thread that hands each ``CoreOutputs`` to a callback; commands go over the same duplex pipe,
pickled and written by a thread of their own, in order, so the event loop never waits for the
pipe (a long prompt, or weights being swapped in). Tokenization, chat templates, streaming and
JSON stay in the server process.

Lifetime: the process ignores SIGINT and SIGTERM (the server decides when it stops: it drains,
then sends ``Stop``); it exits when told to or when its pipe closes (the server is gone, even by
``kill -9``). ``stop`` sends ``Stop``, waits, and kills the process if it does not exit.
SIGUSR1 makes it write every thread's stack to its stderr (the server's), so a hang can be read.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing as mp
import multiprocessing.util as mp_util
import pickle
import queue
import signal
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from samebits.config import EngineConfig
from samebits.engine.engine import LLMEngine
from samebits.engine.grammar import GrammarCompiler
from samebits.llm_options import loaded_with_tokenizer
from samebits.models.parallel import full_bytes
from samebits.server.core_messages import IDLE_CHECK_S, CoreOutputs, Stop
from samebits.server.engine_core import EngineCore
from samebits.text.tokenizer import Tokenizer

log = logging.getLogger("samebits.server")
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class EngineInfo:
    """What the server process needs of the engine it does not hold."""

    config: EngineConfig
    fingerprint: str
    max_model_len: int
    kv_blocks_total: int
    tokenizer: Tokenizer | None
    vocab_size: int
    eos_token_ids: tuple[int, ...]  # the stop ids structured output completes with
    model_bytes: int  # of the served model's whole weights (every rank's shards together)


@dataclass(frozen=True)
class _Failed:
    error: BaseException  # re-raised by the server: the engine could not be built
    trace: str


@dataclass(frozen=True)
class _Start:
    canary_rate: float


class EngineProcess:
    """The server's handle on an engine core process (see the module docstring)."""

    def __init__(self, config: EngineConfig, log_level: str = "warning",
                 tokenizer: str | None = None) -> None:
        """``tokenizer``: another tokenizer's directory, model file or id (vLLM's
        ``--tokenizer``), loaded by the engine process in place of the model's."""
        context = mp.get_context("spawn")  # CUDA cannot be forked; nothing is inherited
        self._conn, child = context.Pipe(duplex=True)
        self._process = context.Process(target=_main, args=(config, child, log_level, tokenizer),
                                        name="samebits-engine-core")
        self._process.start()
        child.close()
        # at exit, before multiprocessing joins its children: close the pipe, so the process
        # (however far it got) reads Stop and exits instead of being waited for forever
        self._close = mp_util.Finalize(self, self._conn.close, exitpriority=10)
        self._reader: threading.Thread | None = None
        info = self._handshake()
        self._outbox = _Outbox(self._conn, "samebits-engine-commands")
        self.config, self.fingerprint = info.config, info.fingerprint
        self.max_model_len, self.kv_blocks_total = info.max_model_len, info.kv_blocks_total
        self.tokenizer, self.model_bytes = info.tokenizer, info.model_bytes
        self.grammars = (GrammarCompiler(info.tokenizer, info.vocab_size, info.eos_token_ids)
                         if info.tokenizer is not None else None)

    def _handshake(self) -> EngineInfo:
        try:
            reply = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            self._process.join(STOP_TIMEOUT_S)
            raise RuntimeError(f"the engine process exited while starting (exit code "
                               f"{self._process.exitcode})") from None
        if isinstance(reply, _Failed):
            self._process.join(STOP_TIMEOUT_S)
            if not isinstance(reply.error, ValueError):  # a bad model or option speaks for itself
                log.error("the engine process failed to start:\n%s", reply.trace)
            raise reply.error
        return reply

    def start(self, canary_rate: float, deliver: Callable[[CoreOutputs | None], None]) -> None:
        """Start the core's loop; ``deliver`` gets each ``CoreOutputs`` on a reader thread, then
        None once the process is gone."""
        self.send(_Start(canary_rate))
        self._reader = threading.Thread(target=self._read, args=(deliver,),
                                        name="samebits-engine-reader", daemon=True)
        self._reader.start()

    def _read(self, deliver: Callable[[CoreOutputs | None], None]) -> None:
        try:
            while True:
                deliver(pickle.loads(self._conn.recv_bytes()))
        except (EOFError, OSError):
            pass
        finally:
            deliver(None)

    def send(self, command: Any) -> None:
        """Queue a command for the process (any thread; commands arrive in order). Once the
        process is gone they are dropped: the reader has then said so (``deliver(None)``)."""
        self._outbox.put(command)

    @property
    def alive(self) -> bool:
        return self._process.is_alive() and (self._reader is None or self._reader.is_alive())

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the core (what runs or waits fails), wait for the process, kill it if it hangs."""
        self.send(Stop())
        self._outbox.close()
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("the engine process did not stop in %g s; killing it", timeout)
            self._process.kill()
            self._process.join()
        if self._reader is not None:
            self._reader.join(timeout)
        self._close()


class _PipeInbox:
    """The core's commands from the server; a closed pipe reads as ``Stop``."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.closed = conn, False

    def get(self, block: bool) -> Any:
        if self.closed:
            return Stop()
        try:
            if not self.conn.poll(IDLE_CHECK_S if block else 0):
                return None
            return pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            self.closed = True
            return Stop()

    def pending(self) -> bool:
        return self.closed or self.conn.poll(0)


def _send(conn: Connection, message: Any) -> None:
    try:
        conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    except OSError:  # the server is gone; the inbox reads Stop next
        pass


class _Outbox:
    """Messages pickled and sent, in order, by a thread of their own: whoever hands one over
    goes on at once. The engine's loop hands over its ``CoreOutputs`` (the pickling runs while
    the engine waits for the device, as vLLM's output thread does); the server its commands.
    ``close`` sends what is left, then returns."""

    def __init__(self, conn: Connection, name: str = "samebits-engine-outbox") -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(conn,), name=name, daemon=True)
        self._thread.start()

    def put(self, message: Any) -> None:
        self._queue.put(message)

    def _run(self, conn: Connection) -> None:
        while (message := self._queue.get()) is not None:
            _send(conn, message)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


def model_bytes(engine: LLMEngine) -> int:
    """Bytes of the engine's whole model weights (under tensor parallel too, where rank 0 holds
    only its shard): the limit on a weight update's files."""
    return full_bytes(engine.loaded.model)


def _portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling, else a RuntimeError with its message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _main(config: EngineConfig, conn: Connection, log_level: str, tokenizer: str | None) -> None:
    """The engine process: build the engine, say so, run the core until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(message)s")
    try:
        engine = engine_with_tokenizer(config, tokenizer)
    except BaseException as e:
        return _send(conn, _Failed(_portable(e), traceback.format_exc()))
    model, tokenizer = engine.loaded.model_config, engine.tokenizer
    eos = tokenizer.eos_token_ids if tokenizer is not None else model.eos_token_ids
    _send(conn, EngineInfo(config, engine.fingerprint, engine.max_model_len,
                           engine.stats().kv_blocks_total, tokenizer, model.vocab_size,
                           tuple(sorted(eos)), model_bytes(engine)))
    inbox = _PipeInbox(conn)
    start = inbox.get(True)
    if isinstance(start, _Start):
        outbox = _Outbox(conn)
        try:
            EngineCore(engine, start.canary_rate).run(inbox, outbox.put)
        finally:
            outbox.close()
    conn.close()


def engine_with_tokenizer(config: EngineConfig, tokenizer: str | None) -> LLMEngine:
    """An engine; with ``tokenizer`` (a directory or a hub id), that tokenizer instead of the
    model's (as ``LLM(tokenizer=...)``; one rank only: under tensor parallel each rank loads its
    own shard)."""
    return LLMEngine(config, loaded_with_tokenizer(config, tokenizer, None, None))
