"""lm-eval 0.4 itself against a real ``samebits serve``: ``local-completions`` with the remote
tokenizer backend (/tokenizer_info, /tokenize: no tokenizer download) runs a loglikelihood task
and a generate_until task kept in tests/server/lm_eval_tasks. Results are identical at
``num_concurrent`` 1 and 8, and every loglikelihood is the sum lm-eval takes of ``LLM.score``'s
logprobs of the same token ids, bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server.conftest import API_KEY

lm_eval = pytest.importorskip("lm_eval")

MODEL = "SmolLM2-135M-Instruct"
TASKS = ["samebits_tiny_mc", "samebits_tiny_gen"]
TASK_DIR = Path(__file__).parent / "lm_eval_tasks"


def _evaluate(server, num_concurrent: int):
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager
    lm = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model=MODEL,
                             tokenizer_backend="remote", num_concurrent=num_concurrent,
                             max_retries=1, max_length=1024, auth_token=API_KEY)
    out = lm_eval.simple_evaluate(model=lm, tasks=TASKS, log_samples=True,
                                  task_manager=TaskManager(include_path=str(TASK_DIR)))
    samples = {t: sorted(([s["doc_id"], s["arguments"], s["resps"]] for s in out["samples"][t]),
                         key=str) for t in TASKS}
    return lm, out["results"], samples


def test_lm_eval_local_completions_identical_at_concurrency_1_and_8(server, offline_llm,
                                                                     monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # what lm-eval sends as the bearer token
    lm, results_1, samples_1 = _evaluate(server, 1)
    _, results_8, samples_8 = _evaluate(server, 8)
    assert samples_1 == samples_8 and results_1 == results_8
    scored = [(args, resp) for _, doc_args, doc_resps in samples_1["samebits_tiny_mc"]
              for args, resp in zip(doc_args, doc_resps, strict=True)]
    assert len(scored) == 12  # 4 questions x 3 choices
    for (context, continuation), resps in scored:
        ctx, cont = lm._encode_pair(context, continuation)
        logprobs = offline_llm.score([ctx + cont])[0][len(ctx) - 1:]
        assert resps[0][0] == sum(logprobs)  # lm-eval's own sum of the same floats
    generated = [r[0][0] for *_, r in samples_1["samebits_tiny_gen"]]
    assert len(generated) == 4 and any(g.strip() for g in generated)
