"""The mixture-of-experts pieces on CPU: the config (sparse layers, names, what is refused), the
routing (top-k ties to the lowest expert id, row invariance), the experts op (a token's bits alone
equal its bits in any batch; the standard per-expert stock matmuls do not -- the negative control
on the same inputs), per-expert HF names through ``named_weights`` / ``update_weights``, and a
model from a config.json alone (``load_format="dummy"``)."""

from __future__ import annotations

import json

import pytest
import torch

from samebits import LLM, SamplingParams
from samebits.config import ModelFormatError
from samebits.distributed.group import TPGroup
from samebits.loader import build_model
from samebits.models import registry
from samebits.models.moe import SparseMoeBlock
from samebits.ops import moe
from samebits.ops.backend import get_backend

QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=128, hidden_size=64,
                 intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                 num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2,
                 mlp_only_layers=[3], max_position_embeddings=256)
INV, STD = get_backend("cpu", True), get_backend("cpu", False)


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    cfg = registry.model_config(QWEN3_MOE)
    assert registry.architecture(cfg.architecture).qk_norm
    assert cfg.moe.top_k == 2 and cfg.moe.renormalize and cfg.moe.round_weights
    assert [cfg.moe.is_sparse(i) for i in range(4)] == [False, True, False, False]
    mixtral = registry.model_config({**QWEN3_MOE, "architectures": ["MixtralForCausalLM"],
                                     "num_local_experts": 4, "norm_topk_prob": False})
    assert mixtral.moe.num_experts == 8 and mixtral.moe.renormalize  # Mixtral always does
    assert mixtral.moe.moe_intermediate_size == 96 and not mixtral.moe.round_weights
    assert all(mixtral.moe.is_sparse(i) for i in range(4))
    qwen2 = registry.model_config({**QWEN3_MOE, "architectures": ["Qwen2MoeForCausalLM"],
                                   "shared_expert_intermediate_size": 48, "qkv_bias": False})
    assert qwen2.attention_bias is False and qwen2.moe.shared_expert_intermediate_size == 48


@pytest.mark.parametrize("change, match", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_sliding_window": True, "sliding_window": 64}, "sliding_window"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"num_experts": None, "num_local_experts": None}, "num_experts"),
])
def test_unsupported_moe_configs_are_refused_by_name(change, match):
    with pytest.raises(ModelFormatError, match=match):
        registry.model_config({k: v for k, v in {**QWEN3_MOE, **change}.items()
                               if v is not None})


def test_top_k_breaks_ties_to_the_lowest_expert_id():
    probs = torch.tensor([[0.1, 0.3, 0.2, 0.3, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2],
                          [0.0, 0.0, 0.5, 0.0, 0.5]])
    vals, ids = moe.topk_lowest_id(probs, 3)
    assert ids.tolist() == [[1, 3, 2], [0, 1, 2], [2, 4, 0]]
    assert torch.equal(vals, probs.gather(1, ids))


def _inputs(t: int = 40, e: int = 8, h: int = 64, i: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h, generator=g), torch.randn(e, 2 * i, h, generator=g) / 8,
            torch.randn(e, h, i, generator=g) / 6, torch.randn(t, e, generator=g) * 3)


@pytest.mark.parametrize("renormalize, round_weights", [(True, True), (False, False)])
def test_routing_of_a_row_is_the_same_alone_and_in_a_batch(renormalize, round_weights):
    logits = _inputs()[3]
    w, ids = moe.select_experts(INV, logits, 2, renormalize, round_weights)
    for i in (0, 17, 39):
        wi, idi = moe.select_experts(INV, logits[i:i + 1], 2, renormalize, round_weights)
        assert torch.equal(wi, w[i:i + 1]) and torch.equal(idi, ids[i:i + 1])
    want = torch.softmax(logits, -1).topk(2, -1)
    assert torch.equal(ids, want.indices.int())
    if renormalize:
        assert torch.allclose(w.sum(-1), torch.ones(40))


def _experts_in_chunks(ops, x, w13, w2, logits, chunk: int, shared=None, scale=None):
    w, ids = moe.select_experts(ops, logits, 2, True, True)
    outs = []
    for lo in range(0, x.shape[0], chunk):
        hi = lo + chunk
        outs.append(moe.fused_experts(ops, x[lo:hi], w13, w2, w[lo:hi], ids[lo:hi],
                                      None if shared is None else shared[lo:hi],
                                      None if scale is None else scale[lo:hi]))
    return torch.cat(outs)


def test_expert_outputs_are_bitwise_the_same_in_any_batch_and_stock_ones_are_not():
    x, w13, w2, logits = _inputs()
    shared, scale = torch.randn(40, 64), torch.rand(40)
    full = _experts_in_chunks(INV, x, w13, w2, logits, 40, shared, scale)
    for chunk in (1, 3, 16):  # each token's expert sees 1 .. 40 neighbours
        assert torch.equal(_experts_in_chunks(INV, x, w13, w2, logits, chunk, shared, scale), full)
    stock = [_experts_in_chunks(STD, x, w13, w2, logits, chunk) for chunk in (1, 40)]
    assert not torch.equal(stock[0], stock[1]), "stock per-expert matmuls follow the batch"
    assert torch.allclose(stock[1], _experts_in_chunks(INV, x, w13, w2, logits, 40), atol=1e-5)


@pytest.fixture(scope="module")
def dummy(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe") / "config.json"
    path.write_text(json.dumps({**QWEN3_MOE, "architectures": ["Qwen2MoeForCausalLM"],
                                "shared_expert_intermediate_size": 48}))
    return LLM(str(path), load_format="dummy", seed=1, num_kv_blocks=16)


def test_dummy_moe_from_a_config_json_runs_with_per_expert_names(dummy):
    model = dummy.engine.loaded.model
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers] == \
        [False, True, False, False]
    names = [n for n, _ in dummy.named_weights()]
    assert len(names) == len(set(names))
    for n in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.7.up_proj.weight",
              "model.layers.1.mlp.shared_expert.down_proj.weight",
              "model.layers.1.mlp.shared_expert_gate.weight", "model.layers.0.mlp.up_proj.weight"):
        assert n in names
    out = dummy.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4


def test_update_of_one_expert_changes_only_its_tokens_and_bad_updates_change_nothing(dummy):
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    before = dict(dummy.named_weights())[name].clone()
    fp = dummy.fingerprint
    with pytest.raises(ValueError, match=r"experts.5.down_proj.weight.*shape"):
        dummy.update_weights({name: torch.zeros(4, 4)})
    assert dummy.fingerprint == fp
    ids = list(range(1, 60))
    logits = dummy.engine.prompt_logits(ids)
    dummy.update_weights({name: before * 3})
    assert torch.equal(dict(dummy.named_weights())[name], before * 3)
    assert dummy.fingerprint != fp and not torch.equal(dummy.engine.prompt_logits(ids), logits)
    dummy.update_weights({name: before})
    assert torch.equal(dummy.engine.prompt_logits(ids), logits)  # no stale packed expert


def test_a_rank_holds_only_its_whole_experts_and_n_must_divide_them():
    cfg = registry.model_config(QWEN3_MOE)  # 8 experts of 32 x 64, 2 KV heads
    rank1 = build_model(cfg, INV, 64, "cpu", torch.float32, TPGroup(1, 2))
    block = rank1.layers[1].mlp
    assert (block.first_expert, block.local_experts) == (4, 4)
    assert tuple(block.experts_gate_up.shape) == (4 * 2 * 32, 64)
    assert tuple(block.experts_down.shape) == (4 * 64, 32)
    # rank 1 reads the rows of experts 4..7 only; the others' spans are empty
    spec = block.experts_down.spec
    assert [spec.span(e) for e in (3, 4)] == [(0, 0), (0, 64)]
    assert spec.sizes(2) == [64, 0]
    bad = registry.model_config({**QWEN3_MOE, "num_experts": 6, "num_key_value_heads": 4})
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide .* 6 experts"):
        build_model(bad, INV, 64, "cpu", torch.float32, TPGroup(0, 4))


def test_gathered_expert_outputs_combined_equal_one_device_and_rank_sums_do_not():
    """Two ranks' held outputs, gathered slot by slot and combined, are the one-device
    experts' bits; adding each rank's own weighted experts first (an all-reduce of partial
    combines: the usual expert-parallel sum) is not."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(24, 64, generator=gen)
    w13, w2 = torch.randn(8, 64, 64, generator=gen) / 8, torch.randn(8, 64, 32, generator=gen) / 6
    weights, ids = moe.select_experts(INV, torch.randn(24, 8, generator=gen), 4, True, False)
    one = moe.fused_experts(INV, x, w13, w2, weights, ids)
    halves = [moe.expert_outputs(INV, x, w13[r * 4:(r + 1) * 4], w2[r * 4:(r + 1) * 4], ids,
                                 r * 4, 8) for r in (0, 1)]
    owner = (ids // 4)[..., None]
    y = torch.where(owner == 0, halves[0], halves[1])
    assert torch.equal(moe.combine_experts(INV, y, weights, None, None), one)
    partial_sums = [moe.combine_experts(INV, h * (owner == r), weights, None, None)
                    for r, h in enumerate(halves)]
    assert not torch.equal(partial_sums[0] + partial_sums[1], one)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_update_weights_takes_a_transformers_models_own_named_parameters(arch, tmp_path):
    """A trainer's transformers model names its experts stacked (``mlp.experts.gate_up_proj``
    [E, 2I, H]) and Mixtral's block ``mlp``: ``update_weights`` takes those names, as loading
    does, and the engine then computes what one loaded from that model's checkpoint computes."""
    from tests.moe_models import write_tiny_moe
    write_tiny_moe(arch, tmp_path / "a", seed=0)
    trained = write_tiny_moe(arch, tmp_path / "b", seed=1)
    names = [name for name, _ in trained.named_parameters()]
    assert "model.layers.0.mlp.experts.gate_up_proj" in names  # the stacked in-memory form
    ids = list(range(1, 40))
    llm = LLM(str(tmp_path / "a"), dtype="float32", num_kv_blocks=16)
    fresh = LLM(str(tmp_path / "b"), dtype="float32", num_kv_blocks=16)
    assert not torch.equal(llm.engine.prompt_logits(ids), fresh.engine.prompt_logits(ids))
    llm.update_weights([(n, p.detach()) for n, p in trained.named_parameters()])
    assert torch.equal(llm.engine.prompt_logits(ids), fresh.engine.prompt_logits(ids))
