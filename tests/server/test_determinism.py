"""Through the HTTP server, a request's bits do not depend on what else the server is doing.

Strict: exact equality of text, per-token logprobs (as JSON floats, which round-trip), top
logprobs, seeds and finish reasons. The negative control runs the same check against a server
in standard mode, where it must find a difference.
"""

from __future__ import annotations

from tests.server.workload import mixed_requests, send_all_at_once, send_one_by_one

SEEDED = dict(model="SmolLM2-135M-Instruct", prompt="Write one sentence about the sea.",
              max_tokens=8, temperature=0.8, seed=42, logprobs=2)


def test_200_concurrent_identical_seeded_requests_give_one_answer(server):
    reqs = [("completions", SEEDED)] * 200
    got = send_all_at_once(server.async_client(), reqs, timeout=1200)
    assert len(got) == 200
    assert len(set(got)) == 1
    server.wait_idle()


def test_100_concurrent_mixed_requests_equal_each_request_alone(server):
    reqs = mixed_requests(100)
    together = send_all_at_once(server.async_client(), reqs, timeout=1200)
    alone = send_one_by_one(server.client(), reqs)
    mismatches = [i for i, (a, b) in enumerate(zip(together, alone, strict=True)) if a != b]
    assert mismatches == []
    server.wait_idle()


def test_negative_control_standard_mode_differs(standard_server):
    reqs = mixed_requests(24)
    together = send_all_at_once(standard_server.async_client(), reqs, timeout=900)
    alone = send_one_by_one(standard_server.client(), reqs)
    mismatches = [i for i, (a, b) in enumerate(zip(together, alone, strict=True)) if a != b]
    assert mismatches, "standard numerics should change some bits with the batch"
