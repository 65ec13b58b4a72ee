"""Trainer forward+backward throughput: ``TrainableLM`` (the engine's invariant kernels forward,
reference-formula backward) against Hugging Face transformers (``attn_implementation="sdpa"``,
stock kernels) on the same model, weights and shapes, in one run. JSON lines, one per shape and
the summary; ratio = trainer tokens/s / HF tokens/s (the goal is >= 0.8).

One step = the logprob of every token given its prefix (all positions of every sequence), summed,
and its backward into every weight. Tokens/s counts every token of the batch. Timed with CUDA
synchronisation around each step, median of ``--iters`` after ``--warmup`` steps, HF and trainer
steps alternating.

    PYTHONPATH=$PWD python benchmarks/train_throughput.py [--config benchmarks/configs/qwen3-0.6b.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "qwen3-0.6b.json"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(steps: list, warmup: int, iters: int) -> list[float]:
    """Median seconds of each step, the steps alternating (the host's speed drifts: a step
    taken now and one taken seconds later are not comparable)."""
    for _ in range(warmup):
        for step in steps:
            step()
    times = [[] for _ in steps]
    for _ in range(iters):
        for step, ts in zip(steps, times, strict=True):
            _sync()
            t0 = time.perf_counter()
            step()
            _sync()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--shapes", default="8x512,32x128,4x1024",
                    help="comma-separated BATCHxLENGTH trainer batches")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=11)
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu for a smoke run")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--formula-backward", action="store_true",
                    help="backward by the reference formulas (no SDPA / Triton fast paths)")
    ap.add_argument("--profile", default="",
                    help="write a torch.profiler table of one trainer step per shape to this file")
    ap.add_argument("--skip-hf", action="store_true", help="time the trainer only")
    args = ap.parse_args()
    if args.formula_backward:
        from samebits.ops import autograd
        autograd.SDPA_BACKWARD = autograd.TRITON_RMS_NORM_BACKWARD = False

    import transformers

    from samebits.train import TrainableLM

    cfg_json = json.loads(Path(args.config).read_text())
    dtype = getattr(torch, args.dtype)
    tl = TrainableLM(args.config, load_format="dummy", device=args.device, dtype=args.dtype,
                     seed=0, max_model_len=2048)
    with torch.device(args.device):
        hf = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**cfg_json), dtype=dtype,
            attn_implementation="sdpa")
    missing, unexpected = hf.load_state_dict(dict(tl.named_weights()), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.train()  # dropout is 0 in these configs; train mode as a trainer runs it
    gen = torch.Generator().manual_seed(0)
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    ratios = []
    for shape in args.shapes.split(","):
        b, n = (int(v) for v in shape.split("x"))
        ids = torch.randint(2, cfg_json["vocab_size"] - 1, (b, n), generator=gen)
        seqs, starts = ids.tolist(), [1] * b
        ids_gpu = ids.to(args.device)

        def trainer_step(seqs=seqs, starts=starts) -> None:
            tl.zero_grad(set_to_none=True)
            torch.cat(tl.logprobs(seqs, starts)).sum().backward()

        def hf_step(ids=ids_gpu) -> None:
            hf.zero_grad(set_to_none=True)
            logits = hf(ids).logits[:, :-1].float()
            torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).sum().backward()

        tokens = b * n
        if args.skip_hf:
            t_hf, (t_tl,) = float("nan"), _time([trainer_step], args.warmup, args.iters)
        else:
            t_hf, t_tl = _time([hf_step, trainer_step], args.warmup, args.iters)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                trainer_step()
                _sync()
            with open(args.profile, "a") as f:
                f.write(f"==== {shape} trainer step, by self CPU time\n")
                f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
                f.write(f"\n==== {shape} trainer step, by device time\n")
                f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30))
                f.write("\n")
        ratio = (tokens / t_tl) / (tokens / t_hf)
        if not args.skip_hf:
            ratios.append(ratio)
        hf_ok = not args.skip_hf
        print(json.dumps({"bench": "train_fwd_bwd", "device": device, "config": Path(args.config).name,
                          "dtype": args.dtype, "batch": b, "seq_len": n, "tokens": tokens,
                          "backward": "formulas" if args.formula_backward else "fast",
                          "trainer_tok_s": round(tokens / t_tl),
                          "hf_sdpa_tok_s": round(tokens / t_hf) if hf_ok else None,
                          "trainer_ms": round(t_tl * 1e3, 2),
                          "hf_sdpa_ms": round(t_hf * 1e3, 2) if hf_ok else None,
                          "ratio": round(ratio, 3) if hf_ok else None}), flush=True)
    if not ratios:
        return
    print(json.dumps({"bench": "train_fwd_bwd_summary", "device": device,
                      "torch": torch.__version__, "transformers": transformers.__version__,
                      "geomean_ratio": round(statistics.geometric_mean(ratios), 3),
                      "min_ratio": round(min(ratios), 3), "goal": 0.8}), flush=True)


if __name__ == "__main__":
    main()
