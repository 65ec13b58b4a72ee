"""A benchmark's clock: progress lines, a time budget, and a watchdog for what has no timeout.

``Clock.phase(name, **fields)`` writes one JSON line to stderr at once (flushed): the phase, the
seconds since the run began and the seconds left of ``--budget-s``, so a run cut by a time limit
shows how far it got. ``Clock.left()`` is what remains of the budget (infinite without one); every
wait of the caller takes ``min(its own timeout, left())``. ``Clock.watch(on_expiry)`` starts a
thread that, ``grace_s`` past the budget, writes every thread's stack to stderr, calls
``on_expiry`` (the caller's cleanup: stop its subprocesses) and exits the process with 124, so a
call that hangs (a device op, a lock) ends with a diagnosis instead of being killed mute.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable


class BudgetSpent(TimeoutError):
    """A wait ran past its own timeout or past the run's budget."""


class Clock:
    def __init__(self, bench: str, budget_s: float | None) -> None:
        self.bench, self.t0 = bench, time.monotonic()
        self.deadline = math.inf if budget_s is None else self.t0 + budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def timeout(self, own_s: float, what: str) -> float:
        """``own_s`` capped by the budget left; ``BudgetSpent`` naming ``what`` if none is."""
        left = min(own_s, self.left())
        if left <= 0:
            raise BudgetSpent(f"no time left for {what} (--budget-s spent)")
        return left

    def phase(self, name: str, **fields) -> None:
        left = self.left()
        row = {"bench": self.bench, "phase": name, "elapsed_s": round(self.elapsed(), 1),
               **({"left_s": round(left, 1)} if math.isfinite(left) else {}), **fields}
        print(json.dumps(row, default=str), file=sys.stderr, flush=True)

    def watch(self, on_expiry: Callable[[], None], grace_s: float = 10.0) -> None:
        """Past the budget and ``grace_s``: stacks to stderr, ``on_expiry()``, exit 124."""
        if not math.isfinite(self.deadline):
            return

        def run() -> None:
            time.sleep(max(0.0, self.left() + grace_s))
            self.phase("watchdog", error="the budget is spent and the run has not ended; "
                       "every thread's stack follows, then the run stops")
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            try:
                on_expiry()
            finally:
                sys.stderr.flush()
                sys.stdout.flush()
                os._exit(124)

        threading.Thread(target=run, name="bench-watchdog", daemon=True).start()
