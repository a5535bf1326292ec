"""The padding proof as a package a contributor extends (graphpass/static_shapes/padding_proof/): which rule
proved a node, the conservative default for an op name without a rule, an op rule registered by name (and
removed again), and the per-call checks of a graph with an attention mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphpass.static_shapes.padding_proof import (
    OP_RULES,
    UNKNOWN_OP,
    OnesCheck,
    PaddingProof,
    op_rule,
    prove_padding,
    remove_op_rule,
)
from graphpass.static_shapes.padding_proof.nodes import _op_name
from helpers import dynamo_graph

B, L, H = 2, 7, 16


def _proof(fn, *inputs, zero_padded=(), **kw) -> tuple[torch.fx.GraphModule, PaddingProof]:
    """The proof of ``fn``'s graph padding dim 1 of every tensor input whose dim 1 is symbolic (tied together)."""
    gm = dynamo_graph(fn, *inputs)
    values = {n.name: n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"}
    syms = {
        v.shape[1].node.expr
        for v in values.values()
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and isinstance(v.shape[1], torch.SymInt)
    }
    zero = [name for name in values if any(z in name for z in zero_padded)]
    return gm, prove_padding(gm, syms, zero_padded=zero, ties={s: min(syms, key=str) for s in syms}, **kw)


def _node(gm: torch.fx.GraphModule, name: str) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and _op_name(n) == name)


def test_causal_sdpa_and_a_pointwise_op_are_proven_by_their_rules():
    def fn(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).relu()

    gm, proof = _proof(fn, torch.randn(B, L, H))
    assert proof.safe and proof.violations == []
    assert proof.proven_by[_node(gm, "scaled_dot_product_attention").name] == "causal_sdpa"
    assert proof.proven_by[_node(gm, "relu").name] == "pointwise"
    assert proof.accepted_by["causal_sdpa"] == 1 and proof.accepted_by["pointwise"] >= 1


def test_a_mask_proven_causal_is_named_as_the_rule():
    def fn(q):
        pos = torch.arange(q.shape[1])
        mask = pos[None, :] <= pos[:, None]
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    gm, proof = _proof(fn, torch.randn(B, L, H))
    assert proof.safe, proof.violations
    assert proof.proven_by[_node(gm, "scaled_dot_product_attention").name] == "causal_mask_sdpa"


def test_an_op_name_without_a_rule_falls_to_the_conservative_default():
    assert "softmax" in OP_RULES and "special_entr" not in OP_RULES

    def fn(x):
        return torch.special.entr(x)

    gm, proof = _proof(fn, torch.randn(B, L, H))
    (v,) = proof.violations
    assert v.reason == "unknown op torch._C._special.special_entr: cannot prove row independence", v
    assert v.node not in proof.proven_by and UNKNOWN_OP.name == "unknown_op"


def test_registering_an_op_rule_changes_the_verdict_and_removing_it_restores_it():
    def fn(x):
        return torch.special.entr(x)

    x = torch.randn(B, L, H)
    _, before = _proof(fn, x)
    assert [v.reason for v in before.violations] == [
        "unknown op torch._C._special.special_entr: cannot prove row independence"
    ]

    @op_rule("special_entr", name="entr_is_pointwise")
    def _entr(node, name, ctx):
        return None  # -x * log(x), element by element

    try:
        gm, after = _proof(fn, x)
        assert after.safe and after.proven_by[_node(gm, "special_entr").name] == "entr_is_pointwise"
        with pytest.raises(ValueError, match="already have a rule"):
            op_rule("special_entr")(lambda node, name, ctx: None)
    finally:
        remove_op_rule("special_entr")
    _, again = _proof(fn, x)
    assert [v.reason for v in again.violations] == [v.reason for v in before.violations]


def test_an_attention_mask_lists_the_ones_check():
    def fn(x, attention_mask):
        n = x.shape[1]
        pos = torch.arange(n)
        causal = (pos[None, :] <= pos[:, None])[None, None] & attention_mask[:, None, None, :].bool()
        mask = torch.where(causal, 0.0, torch.finfo(x.dtype).min)
        scores = x[:, None] @ x[:, None].transpose(-1, -2) + mask
        return F.softmax(scores, dim=-1) @ x[:, None]

    x, am = torch.randn(B, L, H), torch.ones(B, L, dtype=torch.long)
    gm, proof = _proof(fn, x, am, zero_padded=("attention_mask",))
    assert proof.safe, proof.violations
    (check,) = proof.call_checks
    assert isinstance(check, OnesCheck) and check.name == "ones_inputs"
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert [names[i] for i in check.inputs] == [n for n in names if "attention_mask" in n]
    am0 = am.clone()
    am0[0, :2] = 0  # left padding: rows 0 and 1 of sequence 0 see no key
    assert check.holds([am if "attention_mask" in n else None for n in names])
    assert not check.holds([am0 if "attention_mask" in n else None for n in names])
    assert "is not 1 everywhere in this call" in check.why()
    assert proof.proven_by[_node(gm, "softmax").name] == "masked_softmax"


def test_invalid_bucket_reasons_are_typed_and_word_their_own_warning():
    from graphpass.static_shapes.padding_proof import GuardFails, InvalidBucket, NotProven

    guard, topk = GuardFails("Eq(s0, 6) (f.py:3 in scan)"), NotProven("Tensor.topk at node topk keeps k = 4 keys")
    assert isinstance(guard, InvalidBucket) and isinstance(topk, InvalidBucket) and "topk" in topk
    assert guard.warning(16) == (
        "Dynamo's guard Eq(s0, 6) (f.py:3 in scan) fails at bucket 16, so this graph is not the "
        "traced code's graph at that size"
    )
    assert topk.warning(16) == "bucket 16 is not proven for this graph: Tensor.topk at node topk keeps k = 4 keys"
