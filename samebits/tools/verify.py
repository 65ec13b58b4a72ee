"""``samebits verify --url``: audit any OpenAI-compatible server for batch invariance.

Four checks, all through the ``openai`` SDK's chat completions with logprobs:

- identical concurrent: the same seeded request sent ``concurrency`` times at once;
- batch vs alone: different requests (greedy and seeded sampling, mixed lengths) sent at once,
  then the same requests one at a time;
- stream vs non-stream: the same requests streamed and not streamed;
- seeded sampling: seeded sampled requests repeated one after another.

An output is its token strings with their logprobs (floats as the server sent them: exact values
compare exactly). Each check reports how many distinct outputs came back where one was expected,
and per request the first token position where it diverges from its reference (None: identical).
Nothing differs, or the audit failed: the exit status says which (0 only when nothing differs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import asdict, dataclass
from typing import Any

Output = tuple[tuple[str, float], ...]  # (token, logprob) per generated token

WORDS = ("the quick brown fox jumps over a lazy dog while seven curious owls watch from an old "
         "oak tree near the river at dawn").split()


@dataclass(frozen=True)
class CheckResult:
    name: str
    requests: int  # outputs compared with a reference
    distinct: int  # the most distinct outputs one request gave (1: always the same)
    first_divergence: tuple[int | None, ...]  # per request; None: equal to its reference

    @property
    def ok(self) -> bool:
        return all(d is None for d in self.first_divergence)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok,
                "differing": sum(d is not None for d in self.first_divergence)}


def first_divergence(a: Output | list, b: Output | list) -> int | None:
    """The first token position where ``a`` and ``b`` differ (a length difference counts at the
    shorter one's end); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(name: str, outputs: list, references: list) -> CheckResult:
    """Each output against its reference. ``distinct``: the most distinct outputs any one request
    produced (1 when every request always gave one answer); references that are all the same
    request (identical requests) count as one request."""
    divergence = tuple(first_divergence(o, r) for o, r in zip(outputs, references, strict=True))
    per_request: dict[tuple, set[tuple]] = {}
    for o, r in zip(outputs, references, strict=True):
        per_request.setdefault(tuple(r), {tuple(r)}).add(tuple(o))
    return CheckResult(name, len(outputs), max(map(len, per_request.values()), default=1),
                       divergence)


def prompts(count: int, seed: int = 1234) -> list[str]:
    import random
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40))) for _ in range(count)]


def report(results: list[CheckResult], **extra: Any) -> bool:
    """Print one JSON line per check and a summary line; True when nothing differs."""
    for r in results:
        print(json.dumps(r.to_json()))
    ok = all(r.ok for r in results)
    print(json.dumps({**extra, "checks": len(results), "ok": ok,
                      "differing": sum(r.to_json()["differing"] for r in results)}))
    return ok


def plot_file(path: str) -> str:
    """``--plot FILE``'s argument type: refused when the arguments are parsed, before any work,
    if matplotlib (the ``plot`` extra) is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError("needs matplotlib, which is not installed: "
                                         "pip install 'samebits[plot]' (or matplotlib)")
    return path


def plot(results: list[CheckResult], path: str, title: str) -> None:
    """Per check, each request's first divergent token position (a cross), or a dot below the
    token axis where it matched its reference; saved to ``path`` (format from its suffix)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(len(results), 1, figsize=(8, 1.8 * len(results) + 1), squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=True):
        same = [i for i, d in enumerate(r.first_divergence) if d is None]
        diff = [(i, d) for i, d in enumerate(r.first_divergence) if d is not None]
        ax.scatter(same, [-1] * len(same), marker="o", color="tab:green",
                   label="identical (no divergent token)")
        if diff:
            ax.scatter([i for i, _ in diff], [d for _, d in diff], marker="x", color="tab:red",
                       label="first divergent token")
        ax.set_title(f"{r.name}: {len(diff)}/{r.requests} differ, {r.distinct} distinct",
                     fontsize=9)
        ax.set_ylabel("token")
        top = max((d for _, d in diff), default=1) * 1.1 + 1
        ax.set_ylim(-1.5, top)
        ax.set_yticks([t for t in MaxNLocator(nbins=4, integer=True).tick_values(0, top)
                       if 0 <= t <= top])
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[-1, 0].set_xlabel("request")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
