"""``samebits`` command line: generate, verify, bench (and serve)."""

from __future__ import annotations

import argparse
import json
import sys

from samebits.config import ModelFormatError


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory, .gguf file, or config.json "
                   "(with --load-format dummy); default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--standard", action="store_true",
                   help="stock PyTorch ops instead of the batch-invariant ones")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--long-prefill-token-threshold", type=int, default=None, metavar="TOKENS",
                   help="prompt tokens one sequence may prefill in a step, so running streams "
                   "wait at most one such chunk (default: 128 on CPU, no cap on CUDA)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly instead of replaying CUDA graphs")


def _llm(args: argparse.Namespace):
    from samebits import LLM
    kwargs = dict(load_format=args.load_format, device=args.device, dtype=args.dtype,
                  max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  enforce_eager=args.enforce_eager,
                  long_prefill_token_threshold=args.long_prefill_token_threshold)
    if args.standard:
        kwargs["batch_invariant"] = False
    return LLM(args.model, **kwargs)


def cmd_generate(args: argparse.Namespace) -> int:
    from samebits import SamplingParams
    llm = _llm(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    if args.chat:
        result = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        result = llm.generate(args.prompt, params)[0]
    out = result.outputs[0]
    print(out.text)
    if args.verbose:
        print(json.dumps({"token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "seed": out.seed, "system_fingerprint": result.system_fingerprint}),
              file=sys.stderr)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Local: the same prompts alone and in one batch. ``--url``: audit that server
    (samebits.audit). Exit 0 only when no bit differs."""
    if args.url is not None:
        return _verify_url(args)
    from samebits import SamplingParams
    from samebits.verify import compare, plot, report
    llm = _llm(args)
    prompts = [f"Write a short note number {i} about reproducibility." for i in range(args.n)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=1234)
    alone = [_pairs(llm.generate(p, params)[0].outputs[0]) for p in prompts]
    batched = [_pairs(r.outputs[0]) for r in llm.generate(prompts, params)]
    result = compare("batch vs alone", batched, alone)
    if args.plot:
        plot([result], args.plot, f"samebits verify (local, {llm.fingerprint})")
    ok = report([result], prompts=args.n, bitwise_equal=result.requests - result.to_json()[
        "differing"], batch_invariant=llm.config.batch_invariant,
        system_fingerprint=llm.fingerprint)
    return 0 if ok else 1


def _pairs(out) -> list[tuple[int, float]]:
    return list(zip(out.token_ids, out.logprobs, strict=True))


def _verify_url(args: argparse.Namespace) -> int:
    import openai

    from samebits.audit import AuditConfig, audit
    from samebits.verify import plot, report
    config = AuditConfig(args.url, args.api_key, args.model, concurrency=args.n,
                         num_prompts=args.n, max_tokens=args.max_tokens)
    try:
        model, results = audit(config)
    except (openai.OpenAIError, RuntimeError) as e:
        print(f"samebits: error: audit of {args.url} failed: {e}", file=sys.stderr)
        return 2
    if args.plot:
        plot(results, args.plot, f"samebits verify --url {args.url} ({model})")
    return 0 if report(results, url=args.url, model=model) else 1


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/*; repeat to accept several "
                   "keys (default: SAMEBITS_API_KEY, comma-separated keys); an empty key is an "
                   "error")
    p.add_argument("--max-request-bytes", type=int, default=16 * 1024 * 1024,
                   help="larger request bodies get 413 (default 16 MiB)")
    p.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                   help="requests that may wait beyond those running; past it, 503 with "
                   "Retry-After (default: no limit)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: from --model)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's max_position_embeddings)")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the per-request seeds drawn for requests without one")
    p.add_argument("--task", default="generate", choices=["generate", "embed"],
                   help="embed: serve /v1/embeddings from the embedding model --model (default "
                   "all-MiniLM-L6-v2) instead of a generation model")
    p.add_argument("--embed-model", default=None, metavar="DEFAULT|PATH",
                   help="also serve /v1/embeddings from this embedding model, beside the "
                   "generation model (DEFAULT: all-MiniLM-L6-v2)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a jinja chat template (a file, or the template text) to use instead of "
                   "the model's own")
    p.add_argument("--enable-weight-updates", action="store_true",
                   help="add POST /v1/update_weights {\"path\": DIR}: swap in HF-named "
                   "safetensors from DIR on the server between requests")
    p.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="shard the model over N processes (gloo on CPU, NCCL on GPU); the "
                   "segmented arithmetic gives the same bits for every N (samebits.distributed)")
    p.add_argument("--canary-rate", type=_rate, default=0.01,
                   help="share of finished requests the determinism canary replays alone in idle "
                   "time, comparing output hashes (0 turns it off)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])


def _rate(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def cmd_serve(args: argparse.Namespace) -> int:
    """OpenAI-compatible HTTP server (samebits.server)."""
    from samebits.server.app import serve
    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="samebits", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("-v", "--verbose", action="store_true", help="token ids, seed, fingerprint")
    _engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    ver = sub.add_parser("verify", help="check that batching does not change the bits (locally, "
                         "or on any OpenAI-compatible server with --url)")
    ver.add_argument("-n", type=int, default=8, help="prompts (with --url: also the identical "
                     "requests sent at once)")
    ver.add_argument("--max-tokens", type=int, default=16)
    ver.add_argument("--url", default=None, help="audit this OpenAI-compatible server instead "
                     "of a local engine (--model then names the served model; default: the first "
                     "listed)")
    ver.add_argument("--api-key", default=None, help="with --url: the server's API key")
    ver.add_argument("--plot", default=None, metavar="FILE",
                     help="save a plot of the first divergent token per request (matplotlib)")
    _engine_args(ver)
    ver.set_defaults(func=cmd_verify)
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default 127.0.0.1:8000)")
    _serve_args(srv)
    _engine_args(srv)
    srv.set_defaults(func=cmd_serve)
    bench = sub.add_parser("bench", help="throughput, invariant vs standard, JSON lines")
    from samebits import bench as bench_module
    bench_module.add_arguments(bench)
    bench.set_defaults(func=lambda a: bench_module.run_both(a) or 0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ModelFormatError, ValueError) as e:
        print(f"samebits: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
