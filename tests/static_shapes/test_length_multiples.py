"""Dynamo's guards read as "the length is a multiple of c" (``padding_proof/guards.py``), attacked: which guards imply
it (and which look alike but do not), the direction of the ``if pad_size > 0`` guard, the canonical sizes under a
multiple (a fuzzer checks every rewrite against the expression's value at the multiples), and the buckets that are
not multiples."""

import random
from types import SimpleNamespace

import pytest
import sympy
from torch.utils._sympy.functions import FloorDiv, Mod

from graphpass.static_shapes.causal_functions import CAUSAL_FUNCTIONS, benign_guard
from graphpass.static_shapes.padding_proof.guards import MultipleBuckets, MultipleCanon, multiples_from_guards
from graphpass.static_shapes.padding_proof.result import PaddingProof

S = sympy.Symbol("s27", integer=True, positive=True)
T = sympy.Symbol("s16", integer=True, positive=True)
PAD_LINE = "if pad_size > 0:  # transformers/models/mamba2/modeling_mamba2.py:356 in mamba2_chunk_scan"
RESHAPE_LINE = "return input_tensor.reshape(  # transformers/models/mamba2/modeling_mamba2.py:69 in reshape_into_chunks"


def _env(*guards, replacements=None):
    return SimpleNamespace(
        guards=[SimpleNamespace(expr=e, sloc=where) for e, where in guards], replacements=replacements or {}
    )


def _pad(c, s=S):
    return Mod(c - Mod(s, c), c)


def _multiples(env, names=("s27",)):
    return {str(k): c for k, (c, _) in multiples_from_guards(env, set(names), CAUSAL_FUNCTIONS).items()}


def test_the_untaken_pad_branch_makes_the_length_a_multiple():
    assert _multiples(_env((_pad(8) <= 0, PAD_LINE))) == {"s27": 8}


def test_the_taken_pad_branch_is_benign_and_no_fact():
    assert _multiples(_env((_pad(8) > 0, PAD_LINE))) == {}
    assert benign_guard(PAD_LINE, ["mamba2_chunk_scan"], _pad(8) > 0) is not None
    # the untaken branch is not benign: at a bucket that is not a multiple, the graph does not pad where the code does
    assert benign_guard(PAD_LINE, ["mamba2_chunk_scan"], _pad(8) <= 0) is None


@pytest.mark.parametrize(
    "expr, want",
    [
        (sympy.Eq(Mod(S, 16), 0), {"s27": 16}),
        (sympy.Eq(S, FloorDiv(S + _pad(8), 8) * 8), {"s27": 8}),
        (sympy.Eq(Mod(S, 8), 3), {}),  # a residue, not a multiple
        (Mod(S, 8) >= 0, {}),  # always true
        (sympy.Ne(Mod(S, 8), 0), {}),  # the opposite
        (sympy.Eq(Mod(S + T, 8), 0), {}),  # two sizes
        (S > 8, {}),
        (sympy.Eq(Mod(2 * S, 8), 0), {}),  # s a multiple of 4, read only where Mod(s, c) appears itself: not read
    ],
    ids=["eq-mod-16", "reshape-into-chunks", "residue-3", "always", "not-a-multiple", "two-sizes", "bound", "2s"],
)
def test_which_guards_imply_a_multiple(expr, want):
    assert _multiples(_env((expr, RESHAPE_LINE)), names=("s27", "s16")) == want


def test_several_guards_give_their_least_common_multiple():
    env = _env((sympy.Eq(Mod(S, 8), 0), RESHAPE_LINE), (sympy.Eq(Mod(S, 12), 0), RESHAPE_LINE))
    assert _multiples(env) == {"s27": 24}


def test_a_guard_on_a_replaced_symbol_counts_for_the_one_it_was_replaced_by():
    env = _env((_pad(8) <= 0, PAD_LINE), replacements={S: T})
    assert _multiples(env, names=("s16",)) == {"s16": 8}


def test_a_guard_on_an_unpadded_symbol_is_ignored():
    assert _multiples(_env((_pad(8, T) <= 0, PAD_LINE))) == {}


MAMBA_ROWS = FloorDiv(S + _pad(8), 8) * FloorDiv(S + _pad(8), FloorDiv(S + _pad(8), 8))


@pytest.mark.parametrize(
    "expr, c, want",
    [
        (MAMBA_ROWS, 8, S),
        (S + _pad(8), 8, S),
        (FloorDiv(S, 8) * 8, 8, S),
        (FloorDiv(S, 8) * 8, 4, FloorDiv(S, 8) * 8),  # at s = 4: 0, not s
        (FloorDiv(S, 8), 8, FloorDiv(S, 8)),  # s/8: not integer-linear in s, left as it is
        (2 * S + Mod(S, 8) - 1, 8, 2 * S - 1),
        (S + _pad(16), 8, S + _pad(16)),  # a multiple of 8 need not be one of 16
    ],
    ids=["mamba-rows", "s-plus-pad", "floor-times", "floor-times-under-4", "s-over-8", "linear", "pad-16-under-8"],
)
def test_canonical_sizes(expr, c, want):
    assert MultipleCanon({S: c})(expr) == want


def _random_expr(rng, depth=0):
    if depth >= 3 or rng.random() < 0.3:
        return rng.choice([S, S, sympy.Integer(rng.randint(0, 20))])
    op = rng.choice(["add", "mul", "floordiv", "mod", "pad"])
    a = _random_expr(rng, depth + 1)
    c = rng.choice([2, 3, 4, 8, 16, 24])
    if op == "add":
        return a + _random_expr(rng, depth + 1)
    if op == "mul":
        return a * rng.randint(1, 4)
    if op == "floordiv":
        return FloorDiv(a, c)
    if op == "mod":
        return Mod(a, c)
    return a + Mod(c - Mod(a, c), c)


def test_fuzz_every_canonical_size_has_the_value_of_the_size_at_every_multiple():
    """2,000 random size expressions (sums, scalings, floor divisions, remainders, pad-to-a-multiple) under a
    random multiple: where the canonical form differs from the expression, both are evaluated at the first 64
    multiples and must agree; the fuzzer also checks it does rewrite (so it cannot pass by rewriting nothing)."""
    rng = random.Random(38)
    rewritten = 0
    for _ in range(2000):
        expr = _random_expr(rng)
        c = rng.choice([4, 8, 16])
        got = MultipleCanon({S: c})(expr)
        if got == expr:
            continue
        rewritten += 1
        for m in range(1, 65):
            v = sympy.Integer(c * m)
            assert got.xreplace({S: v}) == expr.xreplace({S: v}), (expr, c, got, c * m)
    assert rewritten > 50, rewritten  # 110 with this seed


def test_buckets_that_are_not_multiples_are_invalid_and_all_of_them_refuse():
    proof = PaddingProof()
    MultipleBuckets((("s27", 8, "guard"),)).mark(proof, {"s27"}, (12, 16, 20, 64))
    assert set(proof.invalid_buckets) == {12, 20}
    assert "multiple of 8" in proof.invalid_buckets[12].warning(12) and not proof.refused
    proof = PaddingProof()
    MultipleBuckets((("s27", 8, "guard"),)).mark(proof, {"s27"}, (12, 20))
    assert proof.refused and "make the buckets multiples of 8" in proof.refused[0]
