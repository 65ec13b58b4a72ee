"""The reference run of the determinism suite: every request alone (``max_num_seqs=1``)."""

from __future__ import annotations

import pytest

from samebits import LLM
from tests.determinism.workload import prompt_token_ids, requests, run_shuffled


@pytest.fixture(scope="session")
def reference():
    """(requests, results) with every request alone in the engine."""
    llm = LLM(max_num_seqs=1)
    reqs = requests(prompt_token_ids(llm))
    return reqs, run_shuffled(llm, reqs, None)
