"""Where a served run's time goes, from ``py-spy`` samples of the server's processes.

``Spy({"api": pid, "engine": pid}, directory, tag)`` starts ``py-spy record`` (raw stacks, idle
samples kept, one stack per thread) on each process; ``stop()`` ends the recordings (SIGINT, as
Ctrl-C: py-spy then writes its file) and summarizes each process:

* ``main_idle``: the share of the main thread's samples spent waiting: the API process's event
  loop in ``select`` (nothing to do), the engine process's core blocked on its command pipe (no
  work);
* ``main_top``: the main thread's busy samples by where they are, as shares of all its samples:
  below the event loop's callback (``Handle._run``) for the API process, below ``EngineCore.run``
  for the engine process, ``depth`` frames deep (function names);
* ``threads_active``: per other thread (by name), the share of samples it was not waiting.

py-spy needs ptrace on the processes (root, or a kernel that allows it); ``Spy.available()``
says whether the program is on PATH. Nothing here imports samebits.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections import Counter

ANCHORS = {"api": "Handle._run", "engine": "EngineCore.run"}
IDLE_LEAVES = ("select", "poll", "_poll", "wait", "_recv", "recv", "recv_bytes", "_recv_bytes",
               "sleep", "acquire", "get", "accept", "read")
BLOCKED_IN_C = ("_Outbox._run",)  # frames whose own C call blocks (a SimpleQueue's get)
WRAPPERS = ("decorate_context", "Module._call_impl", "Module._wrapped_call_impl")


class Spy:
    def __init__(self, pids: dict[str, int], directory: str, tag: str, rate: int = 100) -> None:
        self.files = {name: os.path.join(directory, f"spy-{tag}-{name}.txt") for name in pids}
        self.procs = {name: subprocess.Popen(
            [shutil.which("py-spy") or "py-spy", "record", "--pid", str(pid), "--rate", str(rate),
             "--idle", "--threads", "--format", "raw", "--output", self.files[name]],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for name, pid in pids.items()}

    @staticmethod
    def available() -> bool:
        return shutil.which("py-spy") is not None

    def stop(self, depth: int = 3, timeout: float = 30.0) -> dict[str, dict]:
        """Each process's summary (module docstring), or its ``error``."""
        out = {}
        for name, proc in self.procs.items():
            proc.send_signal(signal.SIGINT)
            try:
                _, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            try:
                out[name] = summarize(self.files[name], ANCHORS[name], depth)
            except (OSError, ValueError) as e:
                out[name] = {"error": f"{type(e).__name__}: {e}", "py_spy": err.strip()[-500:]}
        return out


def summarize(path: str, anchor: str, depth: int) -> dict:
    main, main_idle, top = 0, 0, Counter()
    threads, active = Counter(), Counter()
    with open(path) as f:
        for line in f:
            stack, count = line.rstrip("\n").rsplit(" ", 1)
            thread, *frames = stack.split(";")
            n, names = int(count), [fr.split(" (")[0] for fr in frames]
            idle = _idle(names)
            if "MainThread" not in thread:
                name = thread.split(": ", 1)[-1]
                threads[name] += n
                active[name] += 0 if idle else n
                continue
            main += n
            if idle:
                main_idle += n
            else:
                top[_below(names, anchor, depth)] += n
    if main == 0:
        raise ValueError(f"no samples of the main thread in {path}")
    return {"samples": main, "main_idle": round(main_idle / main, 3),
            "main_top": [[k, round(v / main, 3)] for k, v in top.most_common(12)],
            "threads_active": {k: round(active[k] / v, 3) for k, v in threads.most_common(8)}}


def _idle(names: list[str]) -> bool:
    """Waiting: the leaf is a blocking call (the event loop's select, a pipe read, a queue)."""
    if not names:
        return False
    return names[-1] in BLOCKED_IN_C or names[-1].rsplit(".", 1)[-1] in IDLE_LEAVES


def _below(names: list[str], anchor: str, depth: int) -> str:
    at = max((i for i, n in enumerate(names) if n == anchor), default=None)
    rest = [n for n in (names[at + 1:] if at is not None else names[-depth:])
            if not n.endswith(WRAPPERS)]
    return ";".join(rest[:depth]) or (names[-1] if names else "?")
