"""The pass contract, logging, op registration and the code-shape rules of docs/architecture.md."""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import graphpass
from graphpass.config import GraphpassConfig
from graphpass.errors import PassError
from graphpass.passes.base import GraphPass, PassContext
from graphpass.pipeline import PIPELINE, POST_GRAD_PASSES, check_pipeline, inductor_post_grad_pass, run_pipeline

ROOT = Path(__file__).resolve().parents[2]


def _gm():
    def f(x, w):
        return torch.relu(x @ w) + 1

    return torch.fx.symbolic_trace(f)


# ------------------------------------------------------------------ the pass contract


class _Broken(GraphPass):
    name = "broken"

    def run(self, ctx):
        raise KeyError("boom")


class _Unordered(GraphPass):
    """Moves the output's producer after the output: a scheduling bug the runner must catch here."""

    name = "unordered"

    def run(self, ctx):
        out = next(n for n in ctx.gm.graph.nodes if n.op == "output")
        producer = out.args[0]
        out.prepend(producer)  # fine
        out.append(producer)  # producer now after the output that uses it
        return True


class _NoBool(GraphPass):
    name = "no_bool"

    def run(self, ctx):
        return None


class _Counting(GraphPass):
    name = "counting"

    def __init__(self, changed):
        self.changed = changed

    def run(self, ctx):
        if self.changed:
            node = next(n for n in ctx.gm.graph.nodes if n.target is torch.relu)
            node.target = torch.sigmoid
        return self.changed


def _ctx(gm):
    return PassContext(gm=gm, example_inputs=[], config=GraphpassConfig(), graph_name="graph 7 (test)")


def test_an_unexpected_exception_names_the_pass_and_the_graph():
    with pytest.raises(PassError, match=r"pass 'broken' on graph 7 \(test\): KeyError") as info:
        _Broken()(_ctx(_gm()))
    assert isinstance(info.value.__cause__, KeyError)
    assert isinstance(info.value, graphpass.GraphpassError)


def test_a_malformed_graph_fails_at_the_pass_that_made_it():
    with pytest.raises(PassError, match=r"pass 'unordered' .*malformed graph"):
        _Unordered()(_ctx(_gm()))


def test_a_pass_must_say_whether_it_changed_the_graph():
    with pytest.raises(PassError, match=r"returns whether it changed the graph"):
        _NoBool()(_ctx(_gm()))


def test_the_runner_recompiles_only_after_a_change(monkeypatch):
    for changed in (False, True):
        gm = _gm()
        calls = []
        monkeypatch.setattr(gm, "recompile", lambda: calls.append(1) or torch.fx.GraphModule.recompile(gm))
        assert _Counting(changed)(_ctx(gm)) is changed
        assert len(calls) == int(changed)
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    assert torch.equal(gm(x, w), torch.sigmoid(x @ w) + 1)  # the recompiled code runs the change


def test_requires_is_checked_against_the_pipeline():
    check_pipeline(PIPELINE)
    names = [p.name for p in PIPELINE]
    for p in PIPELINE:
        for r in p.requires:
            assert names.index(r) < names.index(p.name)
    reordered = [PIPELINE[1], PIPELINE[0], *PIPELINE[2:]]  # assign_traps before analyze_ownership
    with pytest.raises(PassError, match=r"'assign_traps' .*requires analyze_ownership"):
        check_pipeline(reordered)
    with pytest.raises(PassError, match="requires"):
        run_pipeline(_gm(), [], GraphpassConfig(), passes=reordered)


def test_no_pass_lints_or_recompiles_by_hand():
    """Inside the pass classes (standalone helpers such as ``slice_static_buffers(gm, ...)`` may)."""
    for path in (ROOT / "graphpass" / "passes").glob("*.py"):
        tree = ast.parse(path.read_text())
        for cls in ast.walk(tree):
            if not (isinstance(cls, ast.ClassDef) and any(getattr(b, "id", "") == "GraphPass" for b in cls.bases)):
                continue
            calls = [
                n.func.attr for n in ast.walk(cls) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            ]
            assert "recompile" not in calls and "lint" not in calls, f"{path.name}: {cls.name}"


def test_post_grad_passes_are_declared_in_the_pipeline_and_installed_from_there(monkeypatch):
    """The inductor delegate gets its post-grad pass from pipeline.py, through the backend (only for graphs with loads)."""
    assert [type(p).__name__ for p in POST_GRAD_PASSES] == ["PinBackwardLoads"]
    assert inductor_post_grad_pass(_gm()) is None
    import graphpass.backends as backends
    import torch._inductor.compile_fx as cfx

    seen = {}
    monkeypatch.setattr(
        cfx,
        "compile_fx",
        lambda gm, inputs, config_patches=None: seen.setdefault("patches", config_patches) or gm.forward,
    )
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(2))).eval().requires_grad_(False)
    graphpass.offload(model, graphpass.OffloadConfig(include_patterns=["0", "1"], device="cpu", storage="cpu"))
    gm_box = {}

    def capture_graph(gm, example_inputs):
        gm_box["gm"] = gm
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=graphpass.backend(then=capture_graph))(torch.randn(2, 8))
    from graphpass.pipeline import with_post_grad_passes  # what the backend hands the delegate

    with_post_grad_passes(backends.InductorDelegate()).compile(gm_box["gm"], [])
    assert type(seen["patches"]["post_grad_custom_post_pass"]) is type(POST_GRAD_PASSES[0])


# ------------------------------------------------------------------ logging


def test_each_pass_is_logged_with_its_time_at_debug(caplog):
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(2)))
    with caplog.at_level(logging.DEBUG, logger="graphpass"):
        torch.compile(model, backend=graphpass.backend(then="eager"))(torch.randn(2, 4))
    by_pass = {r.name: r.getMessage() for r in caplog.records if r.name.startswith("graphpass.passes.")}
    assert "graphpass.passes.insert_trap_boundaries" in by_pass
    assert "ms on graph 0" in by_pass["graphpass.passes.insert_trap_boundaries"]
    assert "changed the graph" in by_pass["graphpass.passes.insert_trap_boundaries"]
    assert "graph unchanged" in by_pass["graphpass.passes.analyze_ownership"]


def test_graphpass_log_env_prints_graphs_before_and_after_each_pass():
    code = (
        "import torch, torch.nn as nn, graphpass\n"
        "m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))\n"
        "torch.compile(m, backend=graphpass.backend(then='eager'))(torch.randn(2, 4))\n"
    )
    env = dict(os.environ, GRAPHPASS_LOG="+passes,+graphs")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "before insert_trap_boundaries" in out.stderr and "after insert_trap_boundaries" in out.stderr
    assert "trap_enter" in out.stderr  # the graph after the boundaries were inserted
    env["GRAPHPASS_LOG"] = ""
    quiet = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0 and "[graphpass" not in quiet.stderr


def test_graphpass_never_changes_logging_an_application_set():
    # an application that asked for DEBUG on graphpass's logger keeps it through the first compile
    # (graphpass used to reset it to NOTSET), with GRAPHPASS_LOG unset and after it is set and unset
    code = (
        "import logging, os, torch, torch.nn as nn, graphpass\n"
        "app = logging.StreamHandler(); lg = logging.getLogger('graphpass')\n"
        "lg.setLevel(logging.DEBUG); lg.addHandler(app)\n"
        "gl = logging.getLogger('graphpass.graphs'); gl.setLevel(logging.ERROR)\n"
        "m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))\n"
        "f = torch.compile(m, backend=graphpass.backend(then='eager')); f(torch.randn(2, 4))\n"
        "assert lg.level == logging.DEBUG and lg.handlers == [app] and gl.level == logging.ERROR, (lg.level, lg.handlers, gl.level)\n"
        "os.environ['GRAPHPASS_LOG'] = 'passes'\n"
        "torch._dynamo.reset(); f = torch.compile(m, backend=graphpass.backend(then='eager')); f(torch.randn(3, 4))\n"
        "assert lg.level == logging.INFO and len(lg.handlers) == 2, (lg.level, lg.handlers)\n"
        "os.environ['GRAPHPASS_LOG'] = ''\n"
        "torch._dynamo.reset(); f = torch.compile(m, backend=graphpass.backend(then='eager')); f(torch.randn(5, 4))\n"
        "assert lg.level == logging.DEBUG and lg.handlers == [app] and gl.level == logging.ERROR, (lg.level, lg.handlers, gl.level)\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "GRAPHPASS_LOG"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_torch_trace_holds_each_pass_graph_before_and_after(tmp_path):
    # TORCH_TRACE (torch's structured trace, read by tlparse) gets each pass's graph as an artifact
    code = (
        "import torch, torch.nn as nn, graphpass\n"
        "m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))\n"
        "torch.compile(m, backend=graphpass.backend(then='eager', traps=['0', '1']))(torch.randn(2, 4))\n"
    )
    env = dict(os.environ, TORCH_TRACE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    names = []
    for log in tmp_path.glob("*.log"):
        for line in log.read_text().splitlines():
            if '"artifact"' in line and "graphpass_" in line:
                names.append(line[line.index("graphpass_") :].split('"')[0])
    assert any(n.endswith("_before_insert_trap_boundaries") for n in names), names
    after = [n for n in names if n.endswith("_after_insert_trap_boundaries")]
    assert after, names
    text = "".join(log.read_text() for log in tmp_path.glob("*.log"))
    assert "trap_enter" in text  # the payload after the boundaries went in holds them


# ------------------------------------------------------------------ registration and code shape


_IMPORT_ORDERS_CHILD = """
import os, sys, traceback
import torch  # imported once; each order then runs in a fork that has loaded no graphpass module
assert not [m for m in sys.modules if m.split(".")[0] == "graphpass"], "graphpass was imported before the forks"
failed = []
for first in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        rc = 1
        try:
            __import__(first)
            from graphpass.op_registry import register_all
            register_all()
            for op in ('trap_enter', 'trap_exit', 'capture', 'load_start', 'load_wait', 'evict', 'offload_guard',
                       'accumulate_grad'):
                getattr(torch.ops.graphpass, op).default
            rc = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(rc)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        failed.append(first)
print("failed", *failed)
"""


def test_ops_register_whatever_is_imported_first():
    """Each graphpass module imported first, in a process that had loaded no graphpass module (one
    interpreter importing torch once, a fork per order), registers every op."""
    firsts = (
        "graphpass.offloading.ops",
        "graphpass.capturing.ops",
        "graphpass.ops",
        "graphpass.fx_utils",
        "graphpass.op_registry",
    )
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_ORDERS_CHILD, *firsts], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0 and out.stdout.split() == ["failed"], (out.stdout, out.stderr[-3000:])


def test_no_public_function_is_shadowed_by_a_module():
    import importlib
    import pkgutil

    for info in pkgutil.walk_packages(graphpass.__path__, "graphpass."):
        if info.name != "graphpass.__main__":  # running it is the command line
            importlib.import_module(info.name)
    for name in graphpass.__all__:
        assert not isinstance(getattr(graphpass, name), type(sys)), name


def test_library_code_never_prints():
    for path in list((ROOT / "graphpass").rglob("*.py")) + list((ROOT / "backends").rglob("*.py")):
        if path.name == "cli.py":
            continue
        tree = ast.parse(path.read_text())
        prints = [
            n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "print"
        ]
        assert not prints, f"{path.relative_to(ROOT)}:{prints}"


def test_no_function_is_over_sixty_lines():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "func_lengths.py"), "--limit", "60"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("(over 60 lines)")
    assert out.stdout.strip().splitlines()[-1].startswith("0 of"), out.stdout


MODULE_LINE_LIMIT = 800


def test_no_module_is_over_eight_hundred_lines():
    """One job per room: a module over 800 lines (counted after ``ruff format``, which this bound leaves room
    for) holds several jobs; split it along them (docs/architecture.md)."""
    long = {
        str(path.relative_to(ROOT)): n
        for top in ("graphpass", "backends")
        for path in (ROOT / top).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MODULE_LINE_LIMIT
    }
    assert not long, f"modules over {MODULE_LINE_LIMIT} lines: {long}"


def test_the_map_names_every_module():
    """docs/architecture.md is the map of the tree: every module of graphpass/ and backends/ is named there by
    its file name (``runtime.py``) or its module name (`` `runtime` ``), so a module added or moved without its
    row fails here."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    unnamed = sorted(
        str(path.relative_to(ROOT))
        for top in ("graphpass", "backends")
        for path in (ROOT / top).rglob("*.py")
        if path.stem != "__init__" and f"{path.stem}.py" not in doc and f"`{path.stem}`" not in doc
    )
    assert not unnamed, f"modules docs/architecture.md does not name: {unnamed}"
