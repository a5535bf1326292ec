"""Guards recorded inside an op (``padding_proof/op_guards.py``), attacked: which guards count as recorded inside an
op (and which look alike but are the user's code), and the replay at a bucket's static sizes that stands in for
them, with counter-examples where the layout a guard decided changes what the graph computes.

The graphs are traced by Dynamo here (torch of the main leg). The padded slice ``p[:, :n]`` of ``F.pad``'s
``n + Mod(8 - Mod(n, 8), 8)`` rows is what Mamba-2's padding branch does; its contiguity guard
``Ne(s53*P, s27*s53)`` fails at every multiple of 8, where ``P == n``. On torch 2.9 Mamba-2 records guards of this
kind at the buckets too (tests/xla/test_xla_chunked_scan.py runs it there).
"""

import traceback

import pytest
import torch
import torch.nn.functional as F
from torch._guards import SLoc
from torch.fx.experimental.symbolic_shapes import ShapeGuard

from graphpass.fx_utils import example_of
from graphpass.static_shapes.padding_proof.conditions import GuardBuckets
from graphpass.static_shapes.padding_proof.op_guards import _Replay, recorded_inside_an_op, replay_differs
from graphpass.static_shapes.padding_proof.result import PaddingProof
from graphpass.tensor_utils import shape_env_of

TORCH = torch.__file__.rsplit("/", 1)[0]
TRUSTED = ("mamba2_chunk_scan",)


def _trace(fn, x):
    """Dynamo's graph of ``fn`` at ``x``, every dim dynamic, and the name of the symbol of dim 1."""
    graphs = []

    def grab(gm, _example):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=grab, dynamic=True)
    torch.testing.assert_close(compiled(x.clone()), fn(x.clone()))
    (gm,) = graphs
    (p,) = [n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(example_of(n), torch.Tensor)]
    return gm, str(example_of(p).shape[1])


def _env(gm):
    return shape_env_of([example_of(n) for n in gm.graph.nodes if n.op == "placeholder"])


def _padded(x):
    n = x.shape[1]
    return F.pad(x, (0, 0, 0, (8 - n % 8) % 8))


def contiguity_only(x):  # the slice is contiguous at a multiple only; merging its last two dims is a view either way
    y = _padded(x)[:, : x.shape[1]]
    return y.reshape(x.shape[0], -1) * 2


def view_at_multiples_then_written(x):  # reshape(-1) of the slice: a copy when P != n, a view when P == n
    p = _padded(x)
    z = p[:, : x.shape[1]].reshape(-1)
    z.add_(1)  # at a multiple this write reaches p
    return p * 2


def python_branch(x):
    if x.shape[1] % 8 != 0:
        return x * 2
    return x * 3


X = torch.randn(2, 9, 4)


# --------------------------------------------------------------------------------- which guards


def _guard(frame_file, frame_name, user):
    return ShapeGuard(None, SLoc(traceback.FrameSummary(frame_file, 1, frame_name), user), False)


@pytest.mark.parametrize(
    "frame_file, frame_name, user, want",
    [
        (f"{TORCH}/_dynamo/utils.py", "run_node", "y = x.reshape(-1)  # model.py:3 in f", True),
        (f"{TORCH}/_dynamo/utils.py", "get_fake_value", "y = x.reshape(-1)  # model.py:3 in f", True),
        (f"{TORCH}/_prims_common/__init__.py", "check_contiguous_sizes_strides", None, True),  # AOT's trace
        (f"{TORCH}/_dynamo/variables/tensor.py", "evaluate_expr", "if pad_size > 0:  # model.py:5 in f", False),
        (f"{TORCH}/_dynamo/utils.py", "some_other_helper", "y = f(x)  # model.py:3 in f", False),
        (
            f"{TORCH}/_prims_common/__init__.py",
            "check_contiguous_sizes_strides",
            "y = x.to(memory_format=c)  # m.py:7 in f",
            True,
        ),  # the meta code run_node calls
        (f"{TORCH}/_dynamo/variables/tensor.py", "specialize", "if x.is_contiguous():  # model.py:7 in f", False),
        ("/site-packages/graphpass/analysis.py", "check", None, False),  # a trace outside torch
    ],
    ids=[
        "run-node",
        "get-fake-value",
        "later-trace",
        "python-branch",
        "other-dynamo-frame",
        "meta-code",
        "user-layout-query",
        "not-torch",
    ],
)
def test_which_guards_are_recorded_inside_an_op(frame_file, frame_name, user, want):
    assert recorded_inside_an_op(_guard(frame_file, frame_name, user)) is want


def test_a_guard_whose_location_is_a_string_is_not_read_as_inside_an_op():
    assert not recorded_inside_an_op(ShapeGuard(None, SLoc("somewhere", None), False))
    assert not recorded_inside_an_op(ShapeGuard(None, "a plain string", False))


def test_dynamos_own_guards_are_classified_by_where_they_were_recorded():
    gm, _ = _trace(contiguity_only, X)
    assert _env(gm).guards and all(recorded_inside_an_op(g) for g in _env(gm).guards)
    gm, _ = _trace(python_branch, X)
    branch = [g for g in _env(gm).guards if "Mod" in str(g.expr)]
    assert branch and not any(recorded_inside_an_op(g) for g in branch)


# --------------------------------------------------------------------------------- the replay


@pytest.mark.parametrize("bucket", [16, 24, 64, 12, 13])
def test_a_contiguity_guard_changes_nothing_the_replay_checks(bucket):
    gm, s = _trace(contiguity_only, X)
    assert replay_differs(gm, _env(gm), {s}, bucket) is None


@pytest.mark.parametrize("bucket", [16, 24, 64])
def test_a_reshape_that_becomes_a_view_of_a_written_tensor_is_caught(bucket):
    gm, s = _trace(view_at_multiples_then_written, X)
    why = replay_differs(gm, _env(gm), {s}, bucket)
    assert why is not None and "a view of its operand at the bucket but was a copy when traced" in why, why
    # and that is real: eager at the bucket length writes through, eager at the traced length does not
    at = torch.randn(2, bucket, 4)
    assert not torch.equal(view_at_multiples_then_written(at.clone()), _padded(at) * 2)
    assert torch.equal(view_at_multiples_then_written(X.clone()), _padded(X) * 2)


def test_not_a_multiple_the_written_reshape_stays_a_copy():
    gm, s = _trace(view_at_multiples_then_written, X)
    assert replay_differs(gm, _env(gm), {s}, 12) is None


def test_a_node_whose_traced_sizes_do_not_hold_at_the_bucket_is_named():
    gm, s = _trace(contiguity_only, X)
    y = next(n for n in gm.graph.nodes if n.op == "call_function" and "getitem" in str(n.target))
    pad = next(n for n in gm.graph.nodes if n.op == "call_function" and "pad" in str(n.target))
    y.meta["example_value"] = example_of(pad)  # as if the slice kept every padded row
    why = replay_differs(gm, _env(gm), {s}, 12)
    assert why is not None and y.name in why and "traced sizes say" in why, why


def test_a_graph_that_reads_strides_is_not_replayed():
    def strided(x):
        y = _padded(x)[:, : x.shape[1]]
        return torch.as_strided(y, (x.shape[0], 4), (4, 1)) * 2

    gm, s = _trace(strided, X)
    why = replay_differs(gm, _env(gm), {s}, 16)
    assert why is not None and "as_strided" in why


def test_a_graph_that_fails_at_the_bucket_is_named():
    def chunks_of_three(x):
        return x.reshape(x.shape[0], 3, -1, x.shape[2]).sum(1)

    gm, s = _trace(chunks_of_three, torch.randn(2, 9, 4))
    why = replay_differs(gm, _env(gm), {s}, 16)  # 16 rows are no 3 chunks: the reshape fails
    assert why is not None and "does not run at the bucket" in why, why


# --------------------------------------------------------------------------------- the bucket check


def _mark(fn, buckets):
    gm, s = _trace(fn, X)
    proof = PaddingProof()
    GuardBuckets(gm, TRUSTED).mark(proof, {s}, buckets)
    return proof


def test_guards_recorded_inside_an_op_do_not_invalidate_a_bucket_the_replay_confirms():
    proof = _mark(contiguity_only, (16, 32, 64))
    assert not proof.invalid_buckets and not proof.refused


def test_a_bucket_where_the_replay_differs_is_invalid_with_both_reasons():
    proof = _mark(view_at_multiples_then_written, (12, 16, 32))
    assert set(proof.invalid_buckets) == {16, 32}
    text = proof.invalid_buckets[16].text
    assert "recorded inside an op" in text and "a view of its operand" in text, text


def test_every_bucket_invalid_refuses():
    proof = _mark(view_at_multiples_then_written, (16, 32))
    assert proof.refused and "fails at every bucket" in proof.refused[0]


def test_a_python_branch_on_the_length_still_invalidates_the_bucket():
    proof = _mark(python_branch, (16, 32, 12))
    assert set(proof.invalid_buckets) == {16, 32}
    assert "recorded inside an op" not in proof.invalid_buckets[16].text


# --------------------------------------------------------------------------------- a fuzzer


_STEPS = ["flat", "merge_last", "merge_first", "transpose", "contiguous", "scale", "write", "write_scaled"]


def _program(rng):
    """A random program over ``x [b, n, h]``: pad ``n`` to a multiple of 8, slice the real rows back, then random
    reshapes, moves, copies and in-place writes, returning the padded tensor and the last value (so a write that
    reaches the padded tensor through a view shows)."""
    steps = [rng.choice(_STEPS) for _ in range(rng.randint(1, 4))]

    def fn(x):
        b, n, h = x.shape
        p = F.pad(x, (0, 0, 0, (8 - n % 8) % 8))
        y = p[:, :n]
        for step in steps:
            if step == "flat":
                y = y.reshape(-1)
            elif step == "merge_last" and y.dim() == 3:
                y = y.reshape(y.shape[0], -1)
            elif step == "merge_first" and y.dim() == 3:
                y = y.flatten(0, 1)
            elif step == "transpose" and y.dim() >= 2:
                y = y.transpose(0, 1)
            elif step == "contiguous":
                y = y.contiguous()
            elif step == "scale":
                y = y * 2
            elif step == "write":
                y.add_(1)
            elif step == "write_scaled":
                y.mul_(3)
        return p * 1, y * 1

    return fn, steps


def test_fuzz_the_replay_agrees_with_the_real_run_at_each_bucket():
    """Property: where the replay finds no difference at a bucket, running the traced graph on real tensors of the
    bucket's sizes gives every node the traced sizes and, where the graph writes, the traced view-or-copy relation;
    and the replay's verdict on a written view is right (the graph at the bucket equals eager's program there, and
    a difference it reports is one that real execution shows)."""
    import random

    from graphpass.fx_utils import storage_key

    rng = random.Random(38)
    checked = reported = 0
    for _ in range(40):
        fn, steps = _program(rng)
        n = rng.choice([9, 13, 17, 21, 30])
        gm, s = _trace(fn, torch.randn(2, n, 4))
        env = _env(gm)
        for bucket in (16, 24, 32):
            if bucket < n:
                continue
            why = replay_differs(gm, env, {s}, bucket)
            rec = _Replay(gm)  # here on real tensors
            x = torch.randn(2, bucket, 4)
            args = [
                bucket
                if str(example_of(p)) == s
                else (x if isinstance(example_of(p), torch.Tensor) else int(example_of(p).node.hint))
                for p in gm.graph.nodes
                if p.op == "placeholder"
            ]
            with torch.no_grad():
                rec.run(*args)
            flips = [
                node.name
                for node in rec.results
                if node.op in ("call_function", "call_method")
                and node.args
                and isinstance(node.args[0], torch.fx.Node)
                and isinstance(rec.results[node], torch.Tensor)
                and isinstance(example_of(node), torch.Tensor)
                and (storage_key(example_of(node)) == storage_key(example_of(node.args[0])))
                != (storage_key(rec.results[node]) == storage_key(rec.results[node.args[0]]))
            ]
            writes = any(st.startswith("write") for st in steps)
            if why is None:
                checked += 1
                assert not (writes and flips), (steps, n, bucket, flips)
            else:
                reported += 1
                assert writes and flips, (steps, n, bucket, why)
    print(f"fuzz: {checked} bucket replays agreed, {reported} reported a written view")
    assert checked > 20 and reported > 0, (checked, reported)
