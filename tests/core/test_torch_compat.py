"""graphpass.torch_compat: the one place differences between torch releases are answered."""

from __future__ import annotations

import pytest
import torch

import graphpass
from graphpass.torch_compat import TORCH_RELEASE, source_name, torch_release_tuple


def test_source_name_of_a_real_dynamo_source():
    from torch._dynamo.source import AttrSource, LocalSource

    assert source_name(LocalSource("x")) == "L['x']"
    assert source_name(AttrSource(LocalSource("self"), "w")) == "L['self'].w"


def test_source_name_takes_the_method_of_torch_2_9_and_the_property_of_later_releases():
    class Method:  # torch 2.9
        def name(self):
            return "L['a']"

    class Property:  # torch 2.10 and later
        @property
        def name(self):
            return "L['b']"

    assert source_name(Method()) == "L['a']"
    assert source_name(Property()) == "L['b']"


def test_torch_release_tuple():
    assert torch_release_tuple("2.9.0+cu128") == (2, 9)
    assert torch_release_tuple("2.15.0") == (2, 15)
    assert TORCH_RELEASE == torch_release_tuple(torch.__version__) and TORCH_RELEASE >= (2, 9)


@pytest.mark.inductor
def test_inductor_keeps_the_graphpass_ops_nobody_reads():
    """torch 2.9's inductor removed a fallback op without a mutable schema as dead code: the trap
    boundaries vanished from the compiled code and never ran (keep_marked_ops_in_inductor)."""
    from torch._inductor import config as inductor_config

    def fn(x):
        with graphpass.trap_block("blk"):
            y = x * 2
        return y + 1

    x = torch.randn(4)
    with inductor_config.patch(fx_graph_cache=False):  # a graph cached by another run proves nothing
        compiled = torch.compile(fn, backend=graphpass.backend())
        with graphpass.trace_traps() as events:
            out = compiled(x)
    assert torch.equal(out, x * 2 + 1)
    assert events == [("enter", "blk"), ("exit", "blk")]


def test_keep_marked_ops_in_inductor_is_idempotent():
    from graphpass.torch_compat import INDUCTOR_KEEPS_MARKED_OPS, keep_marked_ops_in_inductor

    keep_marked_ops_in_inductor()
    assert keep_marked_ops_in_inductor() == []  # nothing left to register the second time
    if not INDUCTOR_KEEPS_MARKED_OPS:
        from torch._inductor.lowering import lowerings

        assert getattr(lowerings[torch.ops.graphpass.trap_enter.default], "_graphpass_kept_fallback", False)


def _looped(x):
    for _ in range(2):
        x = x + 1
        torch._dynamo.graph_break()
    return x


def test_a_frame_skipped_for_a_break_inside_a_loop_is_on_record():
    """Dynamo skips a frame with a graph break inside a loop; torch 2.9 only logged that, so the
    offload pass could not see a module's forward run eagerly (count_loop_skips)."""
    from graphpass import dynamo_records

    x = torch.randn(3)
    assert torch.equal(torch.compile(_looped, backend="eager")(x), (x + 1) + 1)
    sites = [s for s in dynamo_records.skipped_frame_sites() if s.name == "_looped"]
    first, last = _looped.__code__.co_firstlineno, max(ln for _, _, ln in _looped.__code__.co_lines() if ln)
    assert sites and all(s.file == __file__ and first <= s.line <= last for s in sites)
