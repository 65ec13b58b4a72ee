"""X-Samebits-Output-Hash: one documented hash of token ids and fp32 logprob bits, carried by every
generation response (header), and by the last chunk of a stream (``output_hash``)."""

from __future__ import annotations

import hashlib
import struct

import httpx

from samebits.server.output_hash import HEADER, output_hash

REQ = dict(model="SmolLM2-135M-Instruct", prompt="Name three colours.", max_tokens=6,
           temperature=0.9, seed=7)


def test_output_hash_is_sha256_of_counts_ids_and_fp32_logprob_bits():
    ids, lps = [5, 70000], [-0.5, -3.0000001]
    blob = struct.pack("<Q", 2) + struct.pack("<2q", *ids) + struct.pack("<2f", *lps)
    assert output_hash([(ids, lps)]) == hashlib.sha256(blob).hexdigest()
    one_bit = struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", -0.5))[0]
                                               + 1))[0]
    assert output_hash([(ids, [one_bit, lps[1]])]) != output_hash([(ids, lps)])
    assert output_hash([([1], [0.0]), ([2], [0.0])]) != output_hash([([1, 2], [0.0, 0.0])])


def _post(server, path: str, body: dict) -> httpx.Response:
    r = httpx.post(f"{server.url}/v1/{path}", json=body, headers=server.headers, timeout=300)
    assert r.status_code == 200, r.text
    return r


def test_completion_and_chat_responses_carry_a_reproducible_output_hash(server):
    first = _post(server, "completions", REQ).headers[HEADER]
    assert _post(server, "completions", REQ).headers[HEADER] == first
    assert _post(server, "completions", {**REQ, "seed": 8}).headers[HEADER] != first
    chat = dict(REQ, messages=[{"role": "user", "content": "Hi"}])
    del chat["prompt"]
    assert len(_post(server, "chat/completions", chat).headers[HEADER]) == 64


def test_stream_last_chunk_carries_the_non_streamed_hash(server):
    want = _post(server, "completions", {**REQ, "n": 2}).headers[HEADER]
    stream = server.client().completions.create(**REQ, n=2, stream=True)
    hashes = [getattr(c, "output_hash", None) for c in stream]
    assert hashes[-1] == want and all(h is None for h in hashes[:-1])
