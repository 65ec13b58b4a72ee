"""``samebits`` command line (also ``python -m samebits``): generate, verify, serve, bench.

The engine options are declared once (``EngineConfig.add_cli_args``) and turned into an
``EngineConfig`` by one builder (``EngineConfig.from_cli_args``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from tqdm import tqdm

from samebits.config import EngineConfig, ModelFormatError

HELP = argparse.ArgumentDefaultsHelpFormatter


def _llm(args: argparse.Namespace, **overrides):
    from samebits import LLM
    return LLM(**dataclasses.asdict(EngineConfig.from_cli_args(args, **overrides)))


def cmd_generate(args: argparse.Namespace) -> int:
    """The text on stdout; with -v, one JSON line after it (token ids, seed, fingerprint)."""
    from samebits import SamplingParams
    llm = _llm(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.text)
    if args.verbose:
        print(json.dumps({"token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "seed": out.seed, "system_fingerprint": out.system_fingerprint}))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Generate the same prompts alone and in one batch; report whether the bits agree."""
    from samebits import SamplingParams
    llm = _llm(args)
    prompts = [f"Write a short note number {i} about reproducibility." for i in range(args.n)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=1234)
    alone = [llm.generate(p, params)[0] for p in tqdm(prompts, desc="alone", unit="prompt")]
    batched = llm.generate(prompts, params, use_tqdm=True)
    same = [a.token_ids == b.token_ids and a.logprobs == b.logprobs
            for a, b in zip(alone, batched, strict=True)]
    mode = "invariant" if llm.config.batch_invariant else "standard"
    print(f"{sum(same)} of {args.n} sampled answers bitwise equal alone and batched "
          f"({mode} numerics)", file=sys.stderr)
    print(json.dumps({"prompts": args.n, "bitwise_equal": sum(same),
                      "batch_invariant": llm.config.batch_invariant,
                      "system_fingerprint": llm.fingerprint}))
    return 0 if all(same) else 1


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (or SAMEBITS_API_KEY)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send; None: derived from --model")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the per-request seeds drawn for requests without one")
    p.add_argument("--task", default="generate", choices=["generate", "embed"],
                   help="embed: serve /v1/embeddings from the embedding model --model "
                   "(all-MiniLM-L6-v2 when none) instead of a generation model")
    p.add_argument("--embed-model", default=None, metavar="DEFAULT|PATH",
                   help="also serve /v1/embeddings from this embedding model, beside the "
                   "generation model (DEFAULT: all-MiniLM-L6-v2)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"], help="server log level")


def cmd_serve(args: argparse.Namespace) -> int:
    """OpenAI-compatible HTTP server (samebits.server)."""
    from samebits.server.app import serve
    return serve(args)


def _generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate text for a prompt", formatter_class=HELP)
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--seed", type=int, default=None,
                     help="sampling seed; None: one is drawn (shown with -v)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("-v", "--verbose", action="store_true",
                     help="also print token ids, seed and fingerprint as JSON on stdout")
    EngineConfig.add_cli_args(gen)
    gen.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="samebits", description=__doc__, formatter_class=HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    ver = sub.add_parser("verify", help="check that batching does not change the bits",
                         formatter_class=HELP)
    ver.add_argument("-n", type=int, default=8, help="number of prompts")
    ver.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt")
    EngineConfig.add_cli_args(ver)
    ver.set_defaults(func=cmd_verify)
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default 127.0.0.1:8000)",
                         formatter_class=HELP)
    _serve_args(srv)
    EngineConfig.add_cli_args(srv)
    srv.set_defaults(func=cmd_serve)
    bench = sub.add_parser("bench", help="throughput, invariant vs standard, JSON lines",
                           formatter_class=HELP)
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
