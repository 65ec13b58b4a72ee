"""``import samebits`` (and its light submodules) does not load torch or the engine."""

from __future__ import annotations

import subprocess
import sys


def test_import_samebits_and_env_loads_neither_torch_nor_the_engine() -> None:
    code = ("import sys, samebits, samebits.env; "
            "print(sorted(m for m in ('torch', 'samebits.llm', 'samebits.engine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_names_resolve_on_first_use() -> None:
    import samebits
    from samebits.llm import LLM
    assert samebits.LLM is LLM
    assert callable(samebits.batch_invariant)
