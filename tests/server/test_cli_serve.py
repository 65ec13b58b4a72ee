"""``samebits serve`` as a vLLM user starts it: the model positionally, vLLM's flags (honoured, or
logged as having no effect), the port checked before the model loads, usage errors from the
subcommand, help without internal names; and the app it builds answers to every served name
(in-process, on a small random model with the default model's tokenizer)."""

from __future__ import annotations

import json
import socket

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from samebits.cli import build_parser, main, settle_serve_args
from samebits.config import EngineConfig
from samebits.loader import resolve_model_dir
from samebits.server import app as server_app
from samebits.server.launch import NO_EFFECT

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=32,
            intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True,
            eos_token_id=2)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-model") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def _serve(*argv: str):
    args = build_parser().parse_args(["serve", *argv])
    settle_serve_args(args)
    return args


def test_the_model_is_positional_or_model_but_not_two_different_ones():
    assert _serve("org/model").model == "org/model"
    assert _serve("--model", "m").model == "m"
    assert _serve("m", "--model", "m").model == "m"
    with pytest.raises(SystemExit):
        _serve("a", "--model", "b")
    with pytest.raises(SystemExit):
        _serve("--task", "embed", "--tokenizer", "tok")


def test_vllm_flags_are_accepted_with_their_meaning():
    args = _serve("--no-enable-prefix-caching", "--max-logprobs", "5", "--tokenizer", "tok",
                  "--served-model-name", "a", "b", "--trust-remote-code",
                  "--disable-log-requests", "--enable-auto-tool-choice",
                  "--tool-call-parser", "hermes", "--enable-prompt-tokens-details")
    assert not EngineConfig.from_cli_args(args).enable_prefix_caching
    assert EngineConfig.from_cli_args(_serve("--enable-prefix-caching")).enable_prefix_caching
    assert (args.max_logprobs, args.tokenizer, args.served_model_name) == (5, "tok", ["a", "b"])
    assert args.enable_prompt_tokens_details and not args.no_engine_process
    assert _serve("--disable-frontend-multiprocessing").no_engine_process  # vLLM's name for it
    for bad in (["--max-logprobs", "21"], ["--tool-call-parser", "mistral"], ["--port", "99999"]):
        with pytest.raises(SystemExit):
            _serve(*bad)


def _no_load(monkeypatch) -> list:
    """Replace the server's start with a record of it (no model is loaded)."""
    started: list = []
    monkeypatch.setattr(server_app, "serve", lambda args: started.append(args) or 0)
    return started


def test_flags_without_effect_are_logged_with_the_reason(monkeypatch, capsys):
    started = _no_load(monkeypatch)
    code = main(["serve", "--port", str(_free_port()), "--trust-remote-code",
                 "--disable-log-requests", "--enable-auto-tool-choice",
                 "--tool-call-parser", "hermes", "--enable-tokenizer-info-endpoint",
                 "--enable-expert-parallel"])
    assert code == 0 and len(started) == 1
    err = capsys.readouterr().err
    assert [line for line in NO_EFFECT.values() if line not in err] == []


def test_a_busy_port_fails_before_the_model_loads(monkeypatch, capsys):
    started = _no_load(monkeypatch)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert started == [] and f"port {port}" in capsys.readouterr().err


def test_a_bad_flag_prints_the_serve_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--gpu-memory-utilisation", "0.9"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: samebits serve" in err
    assert "unrecognized arguments: --gpu-memory-utilisation" in err


@pytest.mark.parametrize("command", [[], ["serve"], ["generate"], ["verify"], ["bench"]])
def test_help_names_no_internal_classes(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    out = capsys.readouterr().out
    for internal in ("EngineConfig", "Namespace", "samebits.", "add_cli_args", "__"):
        assert internal not in out, internal


def test_max_model_len_over_the_models_limit_names_both(tiny_config, monkeypatch, capsys):
    from samebits.server import lifecycle
    monkeypatch.setattr(lifecycle, "run", lambda *a, **k: pytest.fail("the server started"))
    assert main(["serve", tiny_config, "--load-format", "dummy", "--max-model-len", "100000",
                 "--port", str(_free_port())]) == 2
    err = capsys.readouterr().err
    assert "100000" in err and "256" in err


def test_the_served_app_answers_to_every_name(tiny_config):
    tokenizer = str(resolve_model_dir(None))  # the default model's tokenizer, same vocabulary
    args = _serve(tiny_config, "--load-format", "dummy", "--served-model-name", "a", "b",
                  "--tokenizer", tokenizer, "--max-logprobs", "3", "--canary-rate", "0")
    with TestClient(server_app.build_served_app(args, ())) as client:
        ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
        derived = tiny_config.split("/")[-2]
        assert ids == ["a", "b", tiny_config, derived]
        card = client.get(f"/v1/models/{tiny_config}").json()
        assert (card["id"], card["root"], card["max_model_len"]) == (tiny_config, tiny_config,
                                                                     256)
        assert client.get("/v1/models/nope").status_code == 404
        out = client.post("/v1/chat/completions", json=dict(
            model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=2)).json()
        assert out["model"] == "b" and out["usage"]["completion_tokens"] == 2
        bad = client.post("/v1/completions", json=dict(prompt="hi", logprobs=4)).json()
        assert bad["error"]["param"] == "logprobs" and "--max-logprobs" in bad["error"][
            "message"]
        assert _vllm_metrics(client.get("/metrics").text) == {
            "vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0,
            "vllm:kv_cache_usage_perc": 0.0, "vllm:prompt_tokens_total": float(
                out["usage"]["prompt_tokens"]), "vllm:generation_tokens_total": 2.0,
            "vllm:time_to_first_token_seconds_count": 1.0,
            "vllm:inter_token_latency_seconds_count": 1.0,
            "vllm:e2e_request_latency_seconds_count": 1.0,
            "vllm:request_success_total": 1.0,
            "vllm:request_prompt_tokens_sum": float(out["usage"]["prompt_tokens"]),
            "vllm:request_generation_tokens_sum": 2.0, "vllm:request_params_n_count": 1.0,
            "vllm:request_params_max_tokens_sum": 2.0,
            "vllm:prefix_cache_queries_total": float(out["usage"]["prompt_tokens"]),
            "vllm:prefix_cache_hits_total": 0.0, "vllm:cache_config_info": 1.0,
            "vllm:num_preemptions_total": 0.0,
            # the prompt's step, then one decode step for the second token
            "vllm:iteration_tokens_total_sum": float(out["usage"]["prompt_tokens"] + 1),
            "vllm:request_queue_time_seconds_count": 1.0,
            "vllm:request_prefill_time_seconds_count": 1.0,
            "vllm:request_decode_time_seconds_count": 1.0,
            "vllm:request_inference_time_seconds_count": 1.0}
        assert out["usage"]["prompt_tokens_details"] is None  # vLLM's default


def _vllm_metrics(text: str) -> dict[str, float]:
    """vLLM's samples dashboards read (every one labelled with the served model's name)."""
    wanted = {"vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
              "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
              "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
              "vllm:request_success_total", "vllm:request_prompt_tokens_sum",
              "vllm:request_generation_tokens_sum", "vllm:request_params_n_count",
              "vllm:request_params_max_tokens_sum", "vllm:prefix_cache_queries_total",
              "vllm:prefix_cache_hits_total", "vllm:cache_config_info",
              "vllm:num_preemptions_total", "vllm:iteration_tokens_total_sum",
              "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
              "vllm:request_decode_time_seconds_count",
              "vllm:request_inference_time_seconds_count"}
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                assert sample.labels.get("model_name", "a") == "a", sample
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_version_flag_prints_the_version(capsys):
    """``samebits --version``, as ``vllm --version``."""
    import samebits
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"samebits {samebits.__version__}"
