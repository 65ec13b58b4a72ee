"""The xgrammar compiler over the default model's tokenizer: invalid constraints raise a
``ValueError`` saying what is wrong, equal specs share one compiled grammar, and the mask applied
to a row is exactly xgrammar's own (disallowed tokens at -inf, the rest untouched). Its work is
bounded: size limits before compiling, a time limit, a cache bounded in bytes, and a constraint
no output satisfies (or a row with no allowed token) is an error, not a stuck request."""

from __future__ import annotations

import asyncio

import pytest
import torch
import xgrammar as xgr

from samebits.engine.grammar import GrammarCompiler, GrammarError, apply_grammar_masks
from samebits.loader import resolve_model_dir
from samebits.structured_outputs import StructuredOutputsParams as SO
from samebits.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tok = Tokenizer.from_dir(resolve_model_dir(None))
    return GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)


@pytest.mark.parametrize("spec,what", [(SO(json={"type": "nonsense"}), "invalid JSON schema"),
                                       (SO(json="not json"), "invalid JSON schema"),
                                       (SO(regex="(("), "invalid regex"),
                                       (SO(grammar='root ::= "a" |'), "invalid grammar")])
def test_invalid_constraint_raises_value_error_saying_what(compiler, spec, what):
    with pytest.raises(ValueError, match=what):
        compiler.compile(spec)


@pytest.mark.smoke
def test_equal_specs_share_one_compiled_grammar(compiler):
    a = compiler.compile(SO(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    b = compiler.compile(SO(json='{"type": "object", "properties": {"a": {"type": "integer"}}}'))
    assert a is b


class _Seq:
    def __init__(self, grammar) -> None:
        self.grammar = grammar


def test_mask_is_xgrammars_on_constrained_rows_and_leaves_the_input_untouched(compiler):
    seqs = [_Seq(compiler.state(SO(choice=["yes", "no"]))), _Seq(None),
            _Seq(compiler.state(SO(regex=r"\d+")))]
    logits = torch.randn(3, compiler._vocab_size)
    before = logits.clone()
    masked = apply_grammar_masks(logits, seqs)
    assert torch.equal(logits, before) and torch.equal(masked[1], logits[1])
    for row in (0, 2):
        want = logits[row:row + 1].clone()
        bitmask = xgr.allocate_token_bitmask(1, want.shape[-1])
        seqs[row].grammar.fill(bitmask, 0)
        xgr.apply_token_bitmask_inplace(want, bitmask)
        assert torch.equal(masked[row:row + 1], want)
    assert 0 < torch.isfinite(masked[0]).sum() < 10


# ---- bounded grammar work -------------------------------------------------------------------
def _nested(depth: int) -> dict:
    schema: dict = {"type": "object"}
    node = schema
    for _ in range(depth):
        node["properties"] = {"a": {"type": "object"}}
        node = node["properties"]["a"]
    return schema


@pytest.mark.parametrize("spec,what", [
    (SO(json=_nested(1000)), "nested deeper than 64"),
    (SO(json='{"properties":{"a":' * 1000 + "{}" + "}}" * 1000), "nested deeper than 64"),
    (SO(json="[" * 20000 + "]" * 20000), "the JSON schema is 40000 bytes; the limit is 32768"),
    (SO(json={"anyOf": [{}] * 20000}), "larger than 32768 bytes"),
    (SO(json={"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(257)}}),
     "257 properties; the limit is 256"),
    (SO(json={"enum": list(range(300))}), "300 enum values; the limit is 256"),
    (SO(choice=[f"c{i}" for i in range(257)]), "257 choices; the limit is 256"),
    (SO(choice=["x" * 40000]), "the choices is 40000 bytes"),
    (SO(regex="a" * 40000), "the regex is 40000 bytes"),
    (SO(grammar='root ::= "' + "a" * 40000 + '"'), r"the grammar is \d+ bytes; the limit is"),
])
def test_constraint_over_a_limit_is_refused_before_compiling(compiler, spec, what):
    with pytest.raises(ValueError, match=what):
        compiler.submit(spec)
    with pytest.raises(ValueError, match=what):
        compiler.compile(spec)


def test_constraint_no_output_can_satisfy_is_refused(compiler):
    for spec in (SO(json={"$ref": "#"}), SO(regex=r"[^\s\S]")):
        with pytest.raises(ValueError, match="allows no first token"):
            compiler.compile(spec)


def test_cache_is_bounded_in_bytes_least_recently_used_first(compiler):
    tok = compiler._tokenizer
    small = GrammarCompiler(tok, compiler._vocab_size, [0], cache_bytes=100_000)
    specs = [SO(choice=[f"option {i} {j}" for j in range(200)]) for i in range(6)]
    grammars = [small.compile(s) for s in specs]
    sizes = [g.memory_size_bytes for g in grammars]
    assert 0 < small.cached_bytes <= 100_000 < sum(sizes)
    assert small.compile(specs[-1]) is grammars[-1]  # the newest is kept
    assert small.compile(specs[0]) is not grammars[0]  # the oldest was dropped: compiled again
    huge = GrammarCompiler(tok, compiler._vocab_size, [0], cache_bytes=10)
    assert huge.compile(specs[0]) is not huge.compile(specs[0])  # larger than the budget
    assert huge.cached_bytes == 0


def test_concurrent_requests_share_one_compile_in_the_compilers_own_threads(compiler):
    spec = SO(choice=["shared", "compile"])
    fresh = GrammarCompiler(compiler._tokenizer, compiler._vocab_size, [0])
    a, b = fresh.submit(spec), fresh.submit(spec)
    assert a is b
    assert a.result(timeout=60) is fresh.compile(spec)


def test_compile_past_the_time_limit_is_a_value_error(compiler):
    slow = GrammarCompiler(compiler._tokenizer, compiler._vocab_size, [0], timeout_s=1e-4)
    spec = SO(json={"type": "object", "properties": {f"k{i}": {"type": "string"}
                                                      for i in range(200)}})
    with pytest.raises(ValueError, match="did not compile within 0.0001 s"):
        asyncio.run(slow.compile_async(spec))


class _Stuck:
    """A grammar whose mask allows nothing (what a dead-end constraint would do)."""

    def fill(self, bitmask, row) -> None:
        bitmask[row] = 0


def test_a_row_with_no_allowed_token_raises_grammar_error(compiler):
    logits = torch.randn(2, compiler._vocab_size)
    with pytest.raises(GrammarError, match="allows no next token"):
        apply_grammar_masks(logits, [_Seq(None), _Seq(_Stuck())])
