"""The xgrammar compiler over the default model's tokenizer: invalid constraints raise a
``ValueError`` saying what is wrong, equal specs share one compiled grammar, and the mask applied
to a row is exactly xgrammar's own (disallowed tokens at -inf, the rest untouched)."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from samebits.engine.grammar import GrammarCompiler, apply_grammar_masks
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
