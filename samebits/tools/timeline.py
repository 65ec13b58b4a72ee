"""Where a device idles, from a profile's timeline: the union of its kernels' intervals (busy time
that overlapping kernels, e.g. programmatic launches, do not count twice), the gaps between them,
and for each gap the host activity that was running when the device went idle -- the part of a
step (scheduling, a forward's launches, waiting for a result) the device was waiting on.

Times are in any one unit (a torch profile's microseconds); host ranges may nest, and a gap is
charged to the innermost range open at its start, or to ``OUTSIDE`` when none is.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

OUTSIDE = "outside"  # a gap no host range covers the start of
GAP_BUCKETS = (10.0, 100.0, 1000.0)  # a gap's size class: < 10, < 100, < 1000, >= 1000


def merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as disjoint intervals in time order."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def gaps(busy: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The idle intervals between consecutive disjoint ``busy`` intervals."""
    return [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)]


def open_ranges(ranges: Iterable[tuple[str, float, float]], times: Sequence[float]
                ) -> list[str]:
    """For each of ``times`` (ascending), the name of the innermost range ``(name, start, end)``
    open then (start <= t < end), or OUTSIDE: one sweep with a stack of nested open ranges
    (host ranges nest or are disjoint)."""
    todo = sorted(ranges, key=lambda r: (r[1], -r[2]))
    stack: list[tuple[str, float, float]] = []
    out, i = [], 0
    for t in times:
        while i < len(todo) and todo[i][1] <= t:
            while stack and stack[-1][2] <= todo[i][1]:
                stack.pop()
            stack.append(todo[i])
            i += 1
        while stack and stack[-1][2] <= t:
            stack.pop()
        out.append(stack[-1][0] if stack else OUTSIDE)
    return out


def bucket(size: float) -> str:
    """A gap's size class, named by its upper bound (``lt10``) or the last bound (``ge1000``)."""
    i = bisect.bisect_right(GAP_BUCKETS, size)
    return f"lt{GAP_BUCKETS[i]:g}" if i < len(GAP_BUCKETS) else f"ge{GAP_BUCKETS[-1]:g}"


def idle_report(kernels: Iterable[tuple[float, float]],
                ranges: Iterable[tuple[str, float, float]]) -> dict:
    """Busy time (the kernels' union), span (first start to last end), the gaps' total, and the
    gaps' total and count by the host range open when each began and by size class."""
    busy = merged(kernels)
    if not busy:
        return {"busy": 0.0, "span": 0.0, "idle": 0.0, "idle_by_host": {}, "idle_by_size": {}}
    idle = gaps(busy)
    hosts = open_ranges(ranges, [start for start, _ in idle])
    by_host: dict[str, list[float]] = {}
    by_size: dict[str, list[float]] = {}
    for (start, end), host in zip(idle, hosts, strict=True):
        for table, key in ((by_host, host), (by_size, bucket(end - start))):
            entry = table.setdefault(key, [0.0, 0])
            entry[0] += end - start
            entry[1] += 1
    span, total = busy[-1][1] - busy[0][0], sum(e - s for s, e in busy)
    return {"busy": total, "span": span, "idle": span - total,
            "idle_by_host": {k: {"total": v[0], "count": v[1]} for k, v in by_host.items()},
            "idle_by_size": {k: {"total": v[0], "count": v[1]} for k, v in by_size.items()}}
