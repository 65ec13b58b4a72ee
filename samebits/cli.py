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
from samebits.server import limits as server_limits

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
        result = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        result = llm.generate(args.prompt, params)[0]
    out = result.outputs[0]
    print(out.text)
    if args.verbose:
        print(json.dumps({"token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "seed": out.seed, "system_fingerprint": result.system_fingerprint}))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Local: the same prompts alone and in one batch. ``--url``: audit that server
    (samebits.tools.audit). Exit 0 only when no bit differs."""
    if args.url is not None:
        return _verify_url(args)
    from samebits import SamplingParams
    from samebits.tools.verify import compare, plot, report
    llm = _llm(args)
    prompts = [f"Write a short note number {i} about reproducibility." for i in range(args.n)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=1234)
    alone = [_pairs(llm.generate(p, params)[0].outputs[0])
             for p in tqdm(prompts, desc="alone", unit="prompt")]
    batched = [_pairs(r.outputs[0]) for r in llm.generate(prompts, params, use_tqdm=True)]
    result = compare("batch vs alone", batched, alone)
    mode = "invariant" if llm.config.batch_invariant else "standard"
    print(f"{result.requests - result.to_json()['differing']} of {args.n} sampled answers bitwise "
          f"equal alone and batched ({mode} numerics)", file=sys.stderr)
    ok = report([result], prompts=args.n, bitwise_equal=result.requests - result.to_json()[
        "differing"], batch_invariant=llm.config.batch_invariant,
        system_fingerprint=llm.fingerprint)
    if args.plot:  # after the results are printed
        plot([result], args.plot, f"samebits verify (local, {llm.fingerprint})")
    return 0 if ok else 1


def _pairs(out) -> list[tuple[int, float]]:
    return list(zip(out.token_ids, out.token_logprobs, strict=True))


def _verify_url(args: argparse.Namespace) -> int:
    import openai

    from samebits.tools.audit import AuditConfig, audit
    from samebits.tools.verify import plot, report
    config = AuditConfig(args.url, args.api_key, args.model, concurrency=args.n,
                         num_prompts=args.n, max_tokens=args.max_tokens)
    try:
        model, results = audit(config)
    except (openai.OpenAIError, RuntimeError) as e:
        print(f"samebits: error: audit of {args.url} failed: {e}", file=sys.stderr)
        return 2
    ok = report(results, url=args.url, model=model)
    if args.plot:  # after the results are printed
        plot(results, args.plot, f"samebits verify --url {args.url} ({model})")
    return 0 if ok else 1


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_port, default=8000,
                   help="port to listen on (checked free before the model loads)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/*; repeat to accept several "
                   "keys (default: SAMEBITS_API_KEY, comma-separated keys); an empty key is an "
                   "error")
    p.add_argument("--max-request-bytes", type=int, default=16 * 1024 * 1024,
                   help="larger request bodies get 413")
    p.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                   help="requests that may wait beyond those running; past it, 503 with "
                   "Retry-After (None: no limit)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names clients may send for the model (the first is the one "
                   "reported); the model as given to serve is always served too")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the per-request seeds drawn for requests without one")
    p.add_argument("--task", default="generate", choices=["generate", "embed"],
                   help="embed: serve /v1/embeddings from the embedding model --model "
                   "(all-MiniLM-L6-v2 when none) instead of a generation model")
    p.add_argument("--embed-model", default=None, metavar="DEFAULT|PATH",
                   help="also serve /v1/embeddings from this embedding model, beside the "
                   "generation model (DEFAULT: all-MiniLM-L6-v2)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a jinja chat template (a file, or the template text) to use instead of "
                   "the model's own")
    p.add_argument("--enable-weight-updates", action="store_true",
                   help="add POST /v1/update_weights {\"path\": DIR}: swap in HF-named "
                   "safetensors from DIR on the server between requests")
    p.add_argument("--canary-rate", type=_rate, default=0.01,
                   help="share of finished requests the determinism canary replays alone in idle "
                   "time, comparing output hashes (0 turns it off)")
    p.add_argument("--no-engine-process", action="store_true",
                   help="run the engine in a thread of the server process (sharing its GIL) "
                   "instead of a process of its own")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"], help="server log level")
    server_limits.add_cli_args(p)


def _vllm_args(p: argparse.ArgumentParser) -> None:
    """vLLM's serve flags: honoured where samebits has their meaning, accepted with a logged note
    where they have no effect here (samebits.server.launch.NO_EFFECT)."""
    p.add_argument("--enable-prefix-caching", dest="no_prefix_caching", action="store_const",
                   const=False, default=argparse.SUPPRESS,
                   help="reuse cached KV blocks of a shared prefix (the default)")
    p.add_argument("--no-enable-prefix-caching", dest="no_prefix_caching", action="store_const",
                   const=True, default=argparse.SUPPRESS,
                   help="never reuse cached KV blocks (as --no-prefix-caching)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a tokenizer directory to use instead of the model's own")
    p.add_argument("--max-logprobs", type=_max_logprobs, default=20, metavar="N",
                   help="the most logprobs (top_logprobs, logprobs, prompt_logprobs) a request "
                   "may ask for, 0 to 20")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="add usage.prompt_tokens_details.cached_tokens (prompt tokens read from "
                   "the prefix cache) to completion and chat responses")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted; no effect (samebits runs no model code from checkpoints)")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="accepted; no effect (samebits does not log requests)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted; no effect (tool calls are always parsed)")
    p.add_argument("--tool-call-parser", choices=["hermes"], default=None,
                   help="accepted; no effect (samebits parses Hermes <tool_call> blocks)")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="accepted; no effect (GET /tokenizer_info is always served)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="accepted; no effect (under tensor parallel experts are always split by "
                   "expert)")
    p.add_argument("--disable-frontend-multiprocessing", dest="no_engine_process",
                   action="store_true", default=argparse.SUPPRESS,
                   help="the engine in a thread of the server process (as --no-engine-process)")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (1 to 65535)")
    return value


def _max_logprobs(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 20:
        raise argparse.ArgumentTypeError(f"must be in [0, 20] (samebits returns at most 20 "
                                         f"logprobs), got {text}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def settle_serve_args(args: argparse.Namespace) -> None:
    """``serve MODEL`` (vLLM's form) or ``serve --model MODEL``: either sets ``args.model``; two
    different models are a usage error, as is ``--tokenizer`` for an embedding model."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            args.parser.error(f"the model is given twice: {args.model_tag!r} and --model "
                              f"{args.model!r}")
        args.model = args.model_tag
    if args.task == "embed" and args.tokenizer is not None:
        args.parser.error("--tokenizer applies to a generation model (an embedding model reads "
                          "its own tokenizer)")


def cmd_serve(args: argparse.Namespace) -> int:
    """OpenAI-compatible HTTP server (samebits.server); the port is checked before the model
    loads."""
    from samebits.server.app import serve
    from samebits.server.launch import check_port, no_effect_notes
    settle_serve_args(args)
    check_port(args.host, args.port)
    for note in no_effect_notes(args):
        print(f"samebits: {note}", file=sys.stderr)
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
    gen.set_defaults(func=cmd_generate, parser=gen)


DESCRIPTION = ("Reproducible LLM inference: the same request returns the same bits alone or "
               "in any batch. Commands: generate, verify, serve, bench.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="samebits", description=DESCRIPTION,
                                     formatter_class=HELP)
    from samebits import __version__
    parser.add_argument("--version", action="version", version=f"samebits {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    ver = sub.add_parser("verify", help="check that batching does not change the bits (locally, "
                         "or on any OpenAI-compatible server with --url)", formatter_class=HELP)
    ver.add_argument("-n", type=int, default=8, help="prompts (with --url: also the identical "
                     "requests sent at once)")
    ver.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt")
    ver.add_argument("--url", default=None, help="audit this OpenAI-compatible server instead "
                     "of a local engine (--model then names the served model; None: the first "
                     "listed)")
    ver.add_argument("--api-key", default=None, help="with --url: the server's API key")
    from samebits.tools.verify import plot_file
    ver.add_argument("--plot", default=None, metavar="FILE", type=plot_file,
                     help="save a plot of the first divergent token per request (matplotlib)")
    EngineConfig.add_cli_args(ver)
    ver.set_defaults(func=cmd_verify, parser=ver)
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default 127.0.0.1:8000)",
                         formatter_class=HELP)
    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="the model (as --model): HF directory, .gguf file, or config.json")
    _serve_args(srv)
    _vllm_args(srv)
    EngineConfig.add_cli_args(srv)
    srv.set_defaults(func=cmd_serve, parser=srv)
    bench = sub.add_parser("bench", help="throughput, invariant vs standard, JSON lines",
                           formatter_class=HELP)
    from samebits.tools import bench as bench_module
    bench_module.add_arguments(bench)
    bench.set_defaults(func=lambda a: bench_module.run_both(a) or 0, parser=bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top level's
        parser = getattr(args, "parser", None) or build_parser()
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except (ModelFormatError, ValueError) as e:
        print(f"samebits: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
