"""A ``samebits serve`` subprocess that a benchmark can always stop and always diagnose.

It runs in a process group of its own, with its engine process, so ``stop`` ends every process
it started (SIGTERM to the group, then SIGKILL to what is left). Its output goes to a log
file: a server that exits or hangs while starting raises with the log's tail, and ``diagnose``
gives the tail after asking every process of the group for its threads' stacks (``py-spy dump``
where installed; else SIGUSR1, on which the engine process writes its stacks to that log).
``state`` reads the engine steps and time-to-first-token sums so far (/metrics) and the CPU
seconds of the event loop, the rest of the API process, the engine process's main thread (the
core's loop) and its other threads (/proc), for a run's diagnostics.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
from bench_clock import BudgetSpent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WatchedServer:
    def __init__(self, serve_args: list[str], name: str, env: dict[str, str] | None = None
                 ) -> None:
        """Start ``samebits serve *serve_args`` on a free loopback port (returns at once), with
        ``env`` added to the environment."""
        self.name, port = name, free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.model: str | None = None  # the served name, once ready
        args = [sys.executable, "-m", "samebits", "serve", "--host", "127.0.0.1", "--port",
                str(port), "--log-level", "warning", *serve_args]
        self.log = tempfile.NamedTemporaryFile("w", prefix=f"samebits-{name}-", suffix=".log",
                                               delete=False)
        env = {**{k: v for k, v in os.environ.items() if k != "SAMEBITS_API_KEY"},
               "PYTHONUNBUFFERED": "1", **(env or {})}
        # a process group of its own (not a session: whatever ends this run's session ends it)
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     process_group=0)

    def wait_ready(self, timeout: float) -> None:
        """Until /health answers 200 and the served model is known; raises (with the log's tail)
        if the server exits first, ``BudgetSpent`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, timeout=5, trust_env=False) as http:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"samebits serve ({self.name}) exited with "
                                       f"{self.proc.returncode} while starting; its log ends:\n"
                                       f"{self.log_tail()}")
                try:
                    if http.get("/health").status_code == 200:
                        self.model = http.get("/v1/models").json()["data"][0]["id"]
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise BudgetSpent(f"samebits serve ({self.name}) not ready after "
                                      f"{timeout:.0f} s")
                time.sleep(0.25)

    def pids(self) -> list[int]:
        """The API process, then its children (the engine process)."""
        pid = self.proc.pid
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                return [pid, *map(int, f.read().split())]
        except OSError:
            return [pid]

    def state(self) -> dict[str, float]:
        """Engine steps so far (the batch-size histogram's count), the time-to-first-token
        histogram's sum and count (arrival to the step that made the token) and CPU seconds."""
        text = httpx.get(f"{self.url}/metrics", timeout=30, trust_env=False).text
        wanted = {"samebits_batch_size_count": "steps",
                  "samebits_time_to_first_token_seconds_sum": "ttft_sum",
                  "samebits_time_to_first_token_seconds_count": "ttft_count"}
        out = {wanted[f[0]]: float(f[-1]) for f in map(str.split, text.splitlines())
               if f and f[0] in wanted}
        return {**out, **self._cpu_s()}

    def _cpu_s(self) -> dict[str, float]:
        """CPU seconds from /proc (Linux; empty elsewhere): the API process's main thread (the
        event loop) and its other threads, the engine process's main thread (the core's loop)
        and its other threads (the outbox, the torch workers)."""
        keys = ("loop_cpu_s", "api_other_cpu_s", "engine_main_cpu_s", "engine_other_cpu_s")
        out = dict.fromkeys(keys, 0.0)
        api, *children = self.pids()
        try:
            for p, (main, other) in ((api, keys[:2]),
                                     *((c, keys[2:]) for c in children if is_engine_process(c))):
                for tid in os.listdir(f"/proc/{p}/task"):
                    with open(f"/proc/{p}/task/{tid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    key = main if int(tid) == p else other
                    out[key] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            return {}
        return out

    def log_tail(self, lines: int = 60) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def diagnose(self) -> str:
        """Every process's stacks (py-spy, else SIGUSR1 into the log), then the log's tail."""
        dumps, spy = [], shutil.which("py-spy")
        for pid in self.pids():
            if spy is not None:
                r = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True,
                                   text=True, timeout=30, check=False)
                dumps.append(f"py-spy dump --pid {pid} (rc {r.returncode}):\n{r.stdout}{r.stderr}")
            elif is_engine_process(pid):  # faulthandler on SIGUSR1 (the resource tracker has
                os.kill(pid, signal.SIGUSR1)  # none: SIGUSR1 would end it)
        time.sleep(1.0)
        return "\n".join(dumps) + f"\n--- {self.log.name} ends:\n{self.log_tail(200)}"

    def terminate(self) -> None:
        """SIGTERM to the server's process group (it drains, stops its engine, exits)."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 20.0) -> None:
        """``terminate``, wait ``timeout`` s, then SIGKILL to whatever of the group is left."""
        self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        try:  # the API process's children too (the engine process, the resource tracker)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()

def is_engine_process(pid: int) -> bool:
    """A spawned multiprocessing child other than the resource tracker."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return b"spawn_main" in cmdline and b"resource_tracker" not in cmdline
