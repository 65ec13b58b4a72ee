"""Embedding drift with the batch: how far a text's vector moves between "embedded alone" and
"embedded inside a batch of B", and the throughput it costs -- JSON lines, one per (system, B).

    python benchmarks/embedding_drift.py                # 256 texts, B = 1, 4, 16, 64, 256, whole
    python benchmarks/embedding_drift.py --num-texts 64 --batch-sizes 4,16 --systems invariant

Systems: stock sentence-transformers (float32 on CPU; float16 and float32 on GPU when CUDA is
present; skipped when the package is not installed) against samebits on CPU in float32, invariant
and standard (stock ops on padded batches). Texts are shuffled once and cut into consecutive batches
of B, so every text sits beside neighbours of other lengths. Per line: max L2 distance and max abs
difference to the text's own batch-of-1 vector, how many texts changed any bit, the minimum cosine,
and texts/s, tokens/s of the batched run. The last line puts the systems side by side.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable

import torch

from samebits import LLM
from samebits.engine.pooling import embedding_inputs

WORDS = ("the of and a to in is was for on that with as by at from it an be this which or are "
         "river model batch vector kernel request engine market garden winter reproducible "
         "inference embedding retrieval bitwise cosine floating point sum order thread").split()
Embed = Callable[[list[str], int], torch.Tensor]  # (texts, sentence-transformers batch_size)
WHOLE = 0  # batch_size 0: the whole list in one call (sentence-transformers: its default 32,
           # length-sorted; samebits: as many texts per forward as the token budget holds)


def make_texts(n: int, seed: int = 0) -> list[str]:
    """Mixed lengths: word counts log-uniform in [1, 200] (about 3 to 250 tokens)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(round(200 ** rng.random())))
            for _ in range(n)]


def samebits_system(model: str | None, invariant: bool, device: str) -> tuple[Embed, LLM]:
    llm = LLM(model, task="embed", batch_invariant=invariant, device=device, dtype="float32",
              max_num_seqs=256, max_num_batched_tokens=256 * 512)
    return (lambda texts, _: torch.tensor([o.outputs.embedding for o in llm.embed(texts)])), llm


def st_system(device: str, half: bool, model_dir: str) -> Embed:
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(model_dir, device=device)
    model.max_seq_length = 512
    if half:
        model.half()

    def embed(texts: list[str], batch_size: int) -> torch.Tensor:
        out = model.encode(texts, batch_size=batch_size, convert_to_tensor=True)
        return out.float().cpu()
    return embed


def systems(args: argparse.Namespace, model_dir: str) -> dict[str, tuple[str, str, Embed]]:
    """name -> (device, dtype, embed)."""
    out: dict[str, tuple[str, str, Embed]] = {}
    wanted = args.systems.split(",")
    for invariant, name in ((True, "samebits-invariant"), (False, "samebits-standard")):
        if name.removeprefix("samebits-") in wanted:
            out[name] = (args.device, "float32",
                         samebits_system(args.model, invariant, args.device)[0])
    if "st" in wanted:
        try:
            import sentence_transformers  # noqa: F401
        except ImportError:
            print(json.dumps({"bench": "embedding_drift", "skipped": "sentence-transformers",
                              "reason": "not installed"}))
            return out
        out["sentence-transformers"] = ("cpu", "float32", st_system("cpu", False, model_dir))
        if torch.cuda.is_available():
            for half, dtype in ((False, "float32"), (True, "float16")):
                out[f"sentence-transformers-cuda-{dtype}"] = (
                    "cuda", dtype, st_system("cuda", half, model_dir))
    return out


def run_batched(embed: Embed, texts: list[str], order: list[int], size: int
                ) -> tuple[torch.Tensor, float]:
    """Vectors in text order, and seconds, with consecutive batches of ``size`` of ``order``."""
    vectors: list[torch.Tensor | None] = [None] * len(texts)
    step = size or len(order)
    start = time.perf_counter()
    for s in range(0, len(order), step):
        idx = order[s:s + step]
        for i, v in zip(idx, embed([texts[i] for i in idx], size or 32), strict=True):
            vectors[i] = v
    return torch.stack(vectors), time.perf_counter() - start


def drift(got: torch.Tensor, alone: torch.Tensor) -> dict:
    diff = (got.double() - alone.double())
    cos = torch.nn.functional.cosine_similarity(got.double(), alone.double(), dim=1)
    return {"max_l2_distance": diff.norm(dim=1).max().item(), "max_abs_diff": diff.abs().max().item(),
            "texts_changed": int((got != alone).any(dim=1).sum()), "min_cosine": cos.min().item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-texts", type=int, default=256)
    ap.add_argument("--batch-sizes", default="4,16,64,256,0", help="0: the whole list, one call")
    ap.add_argument("--systems", default="st,invariant,standard")
    ap.add_argument("--model", default=None, help="embedding model directory (default: MiniLM)")
    ap.add_argument("--device", default="cpu", help="samebits device (the GPU encoder is unverified)")
    args = ap.parse_args()
    texts = make_texts(args.num_texts)
    _, probe = samebits_system(args.model, True, "cpu")
    n_tokens = sum(len(i) for i in embedding_inputs(probe.engine.loaded).tokenize(texts))
    model_dir = str(probe.engine.loaded.model_dir)
    order = list(range(len(texts)))
    random.Random(1).shuffle(order)
    summary: dict[str, dict] = {}
    for name, (device, dtype, embed) in systems(args, model_dir).items():
        embed(texts[:2], 2)  # warm-up
        alone, alone_s = run_batched(embed, texts, order, 1)
        rows = [{"batch_size": 1, "seconds": alone_s}]
        for size in (int(b) for b in args.batch_sizes.split(",")):
            got, seconds = run_batched(embed, texts, order, size)
            rows.append({"batch_size": size, "seconds": seconds, **drift(got, alone)})
        for row in rows:
            row.update(texts_per_s=round(len(texts) / row["seconds"], 2),
                       tokens_per_s=round(n_tokens / row["seconds"], 1),
                       seconds=round(row["seconds"], 3))
            print(json.dumps({"bench": "embedding_drift", "system": name, "device": device,
                              "dtype": dtype, "texts": len(texts), "tokens": n_tokens, **row}),
                  flush=True)
        summary[name] = {"max_l2_distance": max(r.get("max_l2_distance", 0.0) for r in rows),
                         "best_texts_per_s": max(r["texts_per_s"] for r in rows)}
    print(json.dumps({"bench": "embedding_drift", "summary": summary,
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
