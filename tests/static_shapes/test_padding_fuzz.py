"""The padding-safety fuzzer (graphpass/static_shapes/padding_fuzz/): fixed-seed programs through the full
torch.compile path, the known unsound classes as fixed programs, and tests that the fuzzer does fail (a rule of the
proof made unsound on purpose is caught and shrunk)."""

from __future__ import annotations

import pytest
import torch

from graphpass.static_shapes import padding_fuzz as pf
from graphpass.static_shapes.padding_proof.registry import OP_RULES, OpRule

# Programs of seeds 0 .. N_SEEDS - 1. 300 were asked for; one program costs about 0.3 to 0.9 s here on the shared
# 2-core machine, with the other sessions' load (one Dynamo trace with symbolic sizes dominates). Measured: 120 programs
# in 57 s (the file 64 s in pytest, 85 s wall with the interpreter's start) beside the bench's worker at load ~4; 112 s
# at load ~5-6. So 120, not 300.
N_SEEDS = 120


@pytest.fixture
def one_thread():
    """One intra-op thread: the programs are tiny, and on a shared 2-core machine torch's thread pool costs more than
    it gives (measured: 0.98 s -> 0.59 s per program)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _report(results):
    return "\n\n".join(pf.format_failure(r) for r in results)


def test_fixed_seed_programs_pad_exactly_or_are_refused(one_thread):
    results = pf.fuzz(range(N_SEEDS))
    wrong = [r for r in results if r.category == "WRONG"]
    errors = [r for r in results if r.category == "error"]
    invalid = [r for r in results if r.category in ("invalid", "graph_break")]
    assert not wrong, f"{len(wrong)} programs padded with results unlike eager's:\n\n" + _report(wrong)
    assert not errors, f"{len(errors)} programs crashed:\n\n" + _report(errors)
    assert not invalid, "the generator made programs that do not run eagerly or break the graph: " + "; ".join(
        f"seed {r.program.seed}: {r.detail}" for r in invalid
    )
    counts = pf.summarize(results)["counts"]
    # the property is exercised both ways: many programs padded (and compared), many refused
    assert counts["exact"] >= N_SEEDS // 5, counts
    assert counts["refused"] >= N_SEEDS // 5, counts


# The classes an adversarial review found the proof accepting wrongly (issue 33), as fixed programs.
KNOWN = {
    "sdpa_causal_keys_shifted_slice": (
        pf.Step.of(
            "attn",
            src="shift_k1",
            mask="causal",
            oq=0,
            ok=0,
            cmp="le",
            window=None,
            and_am=False,
            proj=False,
            int_dt=None,
            q_len=4,
        ),
    ),
    "bool_causal_mask_keys_shifted_slice": (
        pf.Step.of(
            "attn",
            src="shift_k1",
            mask="bool",
            oq=0,
            ok=0,
            cmp="le",
            window=None,
            and_am=False,
            proj=False,
            int_dt=None,
            q_len=4,
        ),
    ),
    "sdpa_causal_queries_shorter": (
        pf.Step.of(
            "attn",
            src="k_drop_last",
            mask="causal",
            oq=0,
            ok=0,
            cmp="le",
            window=None,
            and_am=False,
            proj=True,
            int_dt=None,
            q_len=4,
        ),
    ),
    "static_queries_causal_over_padded_keys": (
        pf.Step.of(
            "attn",
            src="static_q",
            mask="causal",
            oq=0,
            ok=0,
            cmp="le",
            window=None,
            and_am=False,
            proj=False,
            int_dt=None,
            q_len=8,
        ),
    ),
    "int8_positions_as_index": (pf.Step.of("intpos", use="index", dt="int8", shift=0),),
    "int8_positions_causal_mask_matmul": (pf.Step.of("intpos", use="cmp_matmul", dt="int8", shift=0),),
    "int8_positions_attention_mask": (
        pf.Step.of(
            "attn",
            src="self",
            mask="bool",
            oq=0,
            ok=0,
            cmp="le",
            window=None,
            and_am=False,
            proj=False,
            int_dt="int8",
            q_len=4,
        ),
    ),
    "uint8_positions_plus_one": (pf.Step.of("intpos", use="cmp_matmul", dt="uint8", shift=1),),
    "conv1d_causal_extra_rows_unsliced": (pf.Step.of("conv", k=3, dilation=1, padding=2, cut="none", act=False),),
    "conv1d_causal_extra_rows_sliced_right": (pf.Step.of("conv", k=3, dilation=1, padding=2, cut="left2", act=False),),
    "conv1d_causal_extra_rows_sliced_centre": (pf.Step.of("conv", k=2, dilation=2, padding=3, cut="centre", act=True),),
    "merge_padded_into_hidden_split_other_order": (pf.Step.of("reshape", v="merge_hidden_wrong"),),
    "flatten_unflatten_other_order": (pf.Step.of("reshape", v="flatten_unflatten_wrong"),),
    "merge_with_batch_other_order": (pf.Step.of("reshape", v="merge_batch_wrong"),),
}


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_known_unsound_classes_are_refused_or_exact(name, one_thread):
    large = name.startswith(("int8", "uint8"))
    for x_fill in (1.5, 0.0):
        r = pf.run_program(pf.Program(steps=KNOWN[name], seed=7, large=large, x_fill=x_fill))
        assert r.category in ("refused", "exact"), pf.format_failure(pf.shrink(r))


def _make_unsound(monkeypatch, names, accept):
    """Replace the op rule of ``names`` (for this test) by one that accepts what ``accept(finding)`` says, and
    otherwise answers as the real rule does."""
    for n in names:
        real = OP_RULES[n]

        def unsound(node, name, ctx, real=real):
            hit = real.check(node, name, ctx)
            return None if hit is not None and accept(hit) else hit

        monkeypatch.setitem(OP_RULES, n, OpRule(real.name + "_made_unsound", unsound))


def _sum_along_the_padded_dim_accepted(monkeypatch):
    _make_unsound(monkeypatch, ["sum"], lambda hit: True)


def test_the_fuzzer_fails_when_a_rule_accepts_a_sum_along_the_padded_dim(monkeypatch, one_thread):
    _sum_along_the_padded_dim_accepted(monkeypatch)
    prog = pf.Program(
        steps=(
            pf.Step.of("pointwise", v="relu"),
            pf.Step.of("reduce", v="sum_s"),
            pf.Step.of("linear", v="linear"),
            pf.Step.of("scan", v="cumsum"),
        ),
        seed=3,
        x_fill=0.5,
    )
    r = pf.run_program(prog)
    assert r.category == "WRONG", (r.category, r.detail)
    shrunk = pf.shrink(r)
    assert shrunk.shrunk is not None and [str(s) for s in shrunk.shrunk.steps] == ["reduce(v='sum_s')"], shrunk.shrunk
    text = pf.format_failure(shrunk)
    assert "[WRONG]" in text and "h = h + h.sum(1, keepdim=True)" in text and "relu" not in text


def test_the_fuzzer_fails_when_conv1d_is_taken_as_causal_whatever_its_padding(monkeypatch, one_thread):
    from graphpass.static_shapes.padding_proof.tables import CONVS

    _make_unsound(monkeypatch, [n for n in CONVS if n in OP_RULES], lambda hit: hit[0] is not None)
    # the first generated programs with a convolution that reads later rows (the generator's own seeds)
    seeds = [
        s
        for s in range(2000)
        if any(
            st.kind == "conv"
            and st.get("cut") in ("centre", "none")
            and 0 < st.get("padding") < (st.get("k") - 1) * st.get("dilation")
            for st in pf.generate(s).steps
        )
    ][:4]
    results = pf.fuzz(seeds, shrink_failures=False)
    wrong = [r for r in results if r.category == "WRONG"]
    assert wrong, [(r.program.seed, r.category, r.detail) for r in results]
    shrunk = pf.shrink(wrong[0])
    assert shrunk.shrunk is not None and [s.kind for s in shrunk.shrunk.steps] == ["conv"], shrunk.shrunk
    assert len(shrunk.shrunk.steps) < len(wrong[0].program.steps) or len(wrong[0].program.steps) == 1
    assert "F.conv1d(" in pf.format_failure(shrunk)


def test_a_program_is_readable_python_and_its_steps_can_be_dropped():
    prog = pf.generate(12345)
    src = pf.program_source(prog)
    compile(src, "<program>", "exec")
    assert "class Program(nn.Module)" in src and "def forward(self, x" in src
    for i in range(len(prog.steps)):  # any sub-list of steps is a program that runs eagerly
        sub = pf.Program(steps=prog.steps[:i] + prog.steps[i + 1 :], seed=prog.seed)
        module = pf.build_module(sub)
        with torch.no_grad():
            module(**{k: v for k, v in pf._inputs(sub, pf._interpret(sub), 9, 0).items()})
