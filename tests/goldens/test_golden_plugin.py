"""The golden-graph plugin for users' own models: ``graphpass.testing``, the ``graphpass_golden``
fixture (through the ``pytest11`` entry point), ``--graphpass-accept-golden`` and ``graphpass golden``."""

from __future__ import annotations

import importlib.metadata
import json
import os
import textwrap
import time

import pytest
import torch

import graphpass
from graphpass.cli import main
from graphpass.golden import GoldenMismatch, is_release_path, meta_path, release_path, summarize
from graphpass.models.corpus import build
from graphpass.testing import assert_golden, check_goldens, golden_check, golden_paths

pytest_plugins = ["pytester"]

USER_TEST = textwrap.dedent(
    """
    import os
    import torch
    import torch.nn as nn


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            y = self.fc(x)
            return torch.relu(y) if os.environ.get("USER_MODEL_VARIANT") == "relu" else y


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x


    def test_net_graph(graphpass_golden):
        torch.manual_seed(0)
        result = graphpass_golden(Net().eval(), torch.randn(2, 8))
        assert result.summary["graphs"] == 1
    """
)


# Each inner pytest run is a child forked from the suite's fork server (tests/forkserver.py, the ``forks``
# fixture of tests/conftest.py), which imported torch and graphpass once: a fresh pytest session (pytest.main) in
# the pytester folder with the test's environment, which loads the plugin from the pytest11 entry point, as for
# users; only the torch import is shared. An in-process run (pytester.runpytest_inprocess) would instead
# re-import torch's lazily imported modules and trip over them.
_INNER_PYTEST = r"""
import json, os, sys
assert "graphpass.testing" not in sys.modules  # the child loads the plugin through its entry point
cwd, env, args = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
os.chdir(cwd)
os.environ.clear()
os.environ.update(env)
sys.path.insert(0, cwd)
import pytest
sys.exit(int(pytest.main(args)))
"""


def run(forks, pytester, *args):
    """One inner pytest run in a child forked from ``forks`` (see _INNER_PYTEST), as a RunResult."""
    start = time.monotonic()
    ret, out, err = forks.run(
        _INNER_PYTEST, pytester.path, json.dumps(dict(os.environ)), json.dumps(list(args)), timeout=300
    )
    assert ret != "hang", "inner pytest run timed out"
    outlines, errlines = out.splitlines(), err.splitlines()
    result = pytest.RunResult(ret, outlines, errlines, time.monotonic() - start)
    print("\n".join(outlines), "\n".join(errlines), sep="\n")  # shown when the test fails
    return result


def test_plugin_is_registered_through_the_pytest11_entry_point():
    eps = [ep for ep in importlib.metadata.entry_points(group="pytest11") if ep.name == "graphpass"]
    assert [ep.value for ep in eps] == ["graphpass.testing"]


def test_fixture_records_passes_fails_with_a_diff_and_re_accepts(forks, pytester, monkeypatch):
    monkeypatch.delenv("GRAPHPASS_ACCEPT_GOLDEN", raising=False)
    monkeypatch.delenv("USER_MODEL_VARIANT", raising=False)
    pytester.makepyfile(test_user=USER_TEST)
    golden = pytester.path / "golden"

    missing = run(forks, pytester, "-q", "-p", "no:cacheprovider")
    missing.assert_outcomes(failed=1)
    missing.stdout.fnmatch_lines(["*golden summary*test_net_graph.summary.json is missing*--graphpass-accept-golden*"])

    run(forks, pytester, "-q", "-p", "no:cacheprovider", "--graphpass-accept-golden").assert_outcomes(passed=1)
    assert sorted(p.name for p in golden.iterdir()) == [
        "test_net_graph.meta.json",
        "test_net_graph.summary.json",
        "test_net_graph.txt",
    ]
    meta = json.loads((golden / "test_net_graph.meta.json").read_text())
    assert meta == {"torch": torch.__version__, "graphpass": graphpass.__version__}
    summary = json.loads((golden / "test_net_graph.summary.json").read_text())
    assert summary["graphs"] == 1 and list(summary["traps"]) == ["layers.0", "layers.1"]
    assert summary["fqn_traps"]["layers.1.fc.weight"] == ["layers.1"]
    assert "trap_enter" in (golden / "test_net_graph.txt").read_text()

    run(forks, pytester, "-q", "-p", "no:cacheprovider").assert_outcomes(passed=1)

    monkeypatch.setenv("USER_MODEL_VARIANT", "relu")  # the model changed: the exact rendering differs
    changed = run(forks, pytester, "-q", "-p", "no:cacheprovider")
    changed.assert_outcomes(failed=1)
    changed.stdout.fnmatch_lines(
        [
            "*GoldenMismatch: graph differs from golden*test_net_graph.txt*",
            "E * --- *test_net_graph.txt (golden)",
            "E * +++ actual",
            "E * @@ -*",
            "E * +*torch.relu(y)*",
        ]
    )

    run(forks, pytester, "-q", "-p", "no:cacheprovider", "--graphpass-accept-golden").assert_outcomes(passed=1)
    run(forks, pytester, "-q", "-p", "no:cacheprovider").assert_outcomes(passed=1)
    monkeypatch.delenv("USER_MODEL_VARIANT")
    monkeypatch.setenv("GRAPHPASS_ACCEPT_GOLDEN", "1")  # the environment variable accepts too
    run(forks, pytester, "-q", "-p", "no:cacheprovider").assert_outcomes(passed=1)
    monkeypatch.delenv("GRAPHPASS_ACCEPT_GOLDEN")
    run(forks, pytester, "-q", "-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_ini_option_names_the_golden_folder(forks, pytester, monkeypatch):
    monkeypatch.delenv("GRAPHPASS_ACCEPT_GOLDEN", raising=False)
    pytester.makeini("[pytest]\ngraphpass_golden_dir = goldens/here\n")
    pytester.makepyfile(test_user=USER_TEST)
    run(forks, pytester, "-q", "-p", "no:cacheprovider", "--graphpass-accept-golden").assert_outcomes(passed=1)
    assert (pytester.path / "goldens" / "here" / "test_net_graph.summary.json").exists()


def _model():
    return build("mlp_stack")


def test_other_torch_release_skips_the_exact_check_but_checks_the_summary(tmp_path, monkeypatch):
    monkeypatch.delenv("GRAPHPASS_ACCEPT_GOLDEN", raising=False)
    model, inputs = _model()
    assert_golden(model, *inputs, name="mlp", directory=tmp_path, accept=True)
    text, summary = golden_paths(tmp_path, "mlp")
    meta_path(text).write_text(json.dumps({"torch": "1.0.0", "graphpass": "0.0.1"}))
    text.write_text("recorded by another torch\n")  # not compared on this release
    with pytest.raises(
        pytest.skip.Exception, match=r"recorded with torch 1\.0\.0.*exact check skipped.*summary is still checked"
    ):
        assert_golden(model, *inputs, name="mlp", directory=tmp_path)
    result = golden_check(model, *inputs, name="mlp", directory=tmp_path)  # no pytest: reported, not skipped
    assert "recorded with torch 1.0.0" in result.exact_skipped
    doc = json.loads(summary.read_text())
    doc["traps"]["layers.1"]["loads"] = 1
    summary.write_text(json.dumps(doc))
    with pytest.raises(GoldenMismatch, match=r'(?s)structural summary differs.*-    "layers.1": \{"loads": 1'):
        assert_golden(model, *inputs, name="mlp", directory=tmp_path)


def test_build_tag_does_not_count_as_another_release(tmp_path, monkeypatch):
    monkeypatch.delenv("GRAPHPASS_ACCEPT_GOLDEN", raising=False)
    model, inputs = _model()
    result = assert_golden(model, *inputs, name="mlp", directory=tmp_path, accept=True)
    release = torch.__version__.split("+")[0]
    meta_path(result.text_path).write_text(json.dumps({"torch": release + "+cu999", "graphpass": "0.1.0"}))
    assert golden_check(model, *inputs, name="mlp", directory=tmp_path).exact_skipped is None


def test_release_goldens_are_recorded_beside_the_main_ones_and_checked_on_their_release(tmp_path, monkeypatch):
    """GRAPHPASS_ACCEPT_GOLDEN=release on another torch release: the main golden stays byte-identical;
    the release gets name.torch<major.minor>.txt where it renders differently, only its meta where it
    does not, and is checked against the one that applies; other releases still skip."""
    monkeypatch.delenv("GRAPHPASS_ACCEPT_GOLDEN", raising=False)
    this = torch.__version__
    main_text = "main golden, recorded on 1.0.0\n"
    text = tmp_path / "g.txt"
    summaries = {tmp_path / "g.summary.json": {"graphs": 1}}
    check_goldens({text: main_text}, summaries, accept=True)
    meta_path(text).write_text(json.dumps({"torch": "1.0.0", "graphpass": "0.0.1"}))
    main_bytes, main_meta = text.read_bytes(), meta_path(text).read_bytes()
    own = release_path(text)
    assert own.name == "g.torch{}.{}.txt".format(*this.split("+")[0].split(".")[:2])
    assert check_goldens({text: "this release renders it differently\n"}, summaries, skip=False)  # skipped

    monkeypatch.setenv("GRAPHPASS_ACCEPT_GOLDEN", "release")  # the environment variable, as documented
    check_goldens({text: "this release renders it differently\n"}, summaries)
    monkeypatch.delenv("GRAPHPASS_ACCEPT_GOLDEN")
    assert text.read_bytes() == main_bytes and meta_path(text).read_bytes() == main_meta
    assert (
        own.read_text() == "this release renders it differently\n"
        and is_release_path(own)
        and not is_release_path(text)
    )
    assert json.loads(meta_path(own).read_text()) == {"torch": this, "graphpass": graphpass.__version__}
    assert check_goldens({text: "this release renders it differently\n"}, summaries, skip=False) == []
    with pytest.raises(GoldenMismatch, match=r"(?s)g\.torch.*\.txt \(golden\).*\+changed"):
        check_goldens({text: "changed\n"}, summaries, skip=False)

    check_goldens({text: main_text}, summaries, accept="release")  # now equal to the main one: only the meta stays
    assert not own.exists() and meta_path(own).exists() and text.read_bytes() == main_bytes
    assert check_goldens({text: main_text}, summaries, skip=False) == []
    with pytest.raises(GoldenMismatch, match=r"(?s)g\.txt \(golden\)"):
        check_goldens({text: "changed\n"}, summaries, skip=False)

    meta_path(own).write_text(json.dumps({"torch": "1.1.0", "graphpass": "0.0.1"}))  # another patch release recorded it
    assert "recorded with torch 1.1.0" in check_goldens({text: "changed\n"}, summaries, skip=False)[0]
    with pytest.raises(GoldenMismatch, match="structural summary differs"):  # summaries are never per release
        check_goldens({text: main_text}, {tmp_path / "g.summary.json": {"graphs": 2}}, accept="release")
    with pytest.raises(graphpass.ConfigError, match="accept"):
        check_goldens({text: main_text}, summaries, accept="yes")


def test_release_accept_writes_the_main_golden_where_this_release_recorded_it(tmp_path):
    model, inputs = _model()
    result = assert_golden(
        model, *inputs, name="mlp", directory=tmp_path, accept="release"
    )  # nothing yet: the main one
    assert result.accepted == "release" and result.text_path.exists() and not release_path(result.text_path).exists()
    before = result.text_path.read_bytes()
    assert_golden(model, *inputs, name="mlp", directory=tmp_path, accept="release")  # recorded on this release
    assert result.text_path.read_bytes() == before and not meta_path(release_path(result.text_path)).exists()
    assert golden_check(model, *inputs, name="mlp", directory=tmp_path).exact_skipped is None


def test_summary_of_an_offloaded_model_with_a_capture(tmp_path):
    model, inputs = build("tiny_transformer")
    model.requires_grad_(False)
    graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="cpu", prefetch_distance=1))
    result = assert_golden(
        model, *inputs, name="tt", directory=tmp_path, accept=True, capture=["layers.0-1", "lm_head"]
    )
    s = result.summary
    assert s["graphs"] == 1 and s["schedule"] == ["layers.0", "layers.1"]
    assert s["traps"] == {
        "layers.0": {"loads": 1, "evictions": 1, "captures": 1},
        "layers.1": {"loads": 1, "evictions": 1, "captures": 1},
        "(outside traps)": {"loads": 0, "evictions": 0, "captures": 1},
    }
    assert s["fqn_traps"]["layers.0.attn.qkv.weight"] == ["layers.0"] and s["fqn_traps"]["norm.weight"] == []
    text = result.text_path.read_text()
    assert "schedule peak" in text and "graphpass.capture.default('lm_head'" in text and "graphpass.evict" in text
    assert (
        golden_check(model, *inputs, name="tt", directory=tmp_path, capture=["layers.0-1", "lm_head"]).exact_skipped
        is None
    )


def test_graph_breaks_count_graphs():
    model, inputs = build("graph_break")
    gp = graphpass.backend(then="eager")
    with torch.no_grad():
        torch.compile(model, backend=gp)(*inputs)
    assert summarize(gp.graphs)["graphs"] == len(gp.graphs) > 1


def test_bad_golden_name_is_refused(tmp_path):
    with pytest.raises(graphpass.ConfigError, match="golden name"):
        golden_paths(tmp_path, "../escape")


def test_cli_golden_accept_check_and_diff(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GRAPHPASS_ACCEPT_GOLDEN", raising=False)
    spec = "graphpass.models.corpus:mlp_stack"
    assert main(["golden", spec, "--dir", str(tmp_path)]) == 1
    assert "is missing" in capsys.readouterr().out
    assert main(["golden", spec, "--dir", str(tmp_path), "--accept"]) == 0
    assert "accepted mlp_stack" in capsys.readouterr().out
    assert main(["golden", spec, "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ok mlp_stack: structural summary matches" in out and "ok mlp_stack: exact rendering matches" in out
    text = tmp_path / "mlp_stack.txt"
    text.write_text(text.read_text().replace("trap_enter", "trap_enter_renamed", 1))
    assert main(["golden", spec, "--dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL mlp_stack: graph differs from golden") and "--accept" in out
    assert "\n+++ actual\n" in out and "\n-" in out and "trap_enter_renamed" in out
    assert main(["golden", spec, "--dir", str(tmp_path), "--accept"]) == 0
    assert main(["golden", spec, "--dir", str(tmp_path)]) == 0


def test_cli_golden_help_has_an_example(capsys):
    with pytest.raises(SystemExit) as info:
        main(["golden", "--help"])
    assert info.value.code == 0
    assert "example:\n  graphpass golden " in capsys.readouterr().out


CLASS_TESTS = USER_TEST.replace("def test_net_graph(graphpass_golden):", "def _unused():") + textwrap.dedent(
    """
    class TestPlain:
        def test_graph(self, graphpass_golden):
            torch.manual_seed(0)
            graphpass_golden(Net().eval(), torch.randn(2, 8))


    class TestRelu:
        def test_graph(self, graphpass_golden):
            os.environ["USER_MODEL_VARIANT"] = "relu"  # another graph under the same method name
            try:
                torch.manual_seed(0)
                graphpass_golden(Net().eval(), torch.randn(2, 8))
            finally:
                del os.environ["USER_MODEL_VARIANT"]


    def test_graph(graphpass_golden):
        torch.manual_seed(0)
        graphpass_golden(Net().eval(), torch.randn(2, 8))
    """
)


def test_tests_in_two_classes_with_one_method_name_have_their_own_goldens(forks, pytester, monkeypatch):
    """Issue 22 item 12: both classes' test_graph wrote and read golden/test_graph.*, so the second
    accepted overwrote the first and the first then failed (or passed against the wrong graph)."""
    monkeypatch.delenv("GRAPHPASS_ACCEPT_GOLDEN", raising=False)
    monkeypatch.delenv("USER_MODEL_VARIANT", raising=False)
    pytester.makepyfile(test_user=CLASS_TESTS)
    golden = pytester.path / "golden"
    run(forks, pytester, "-q", "-p", "no:cacheprovider", "--graphpass-accept-golden").assert_outcomes(passed=3)
    assert sorted(p.name for p in golden.glob("*.txt")) == [
        "TestPlain.test_graph.txt",
        "TestRelu.test_graph.txt",
        "test_graph.txt",
    ]  # a module-level test keeps its name
    assert "relu" in (golden / "TestRelu.test_graph.txt").read_text()
    assert "relu" not in (golden / "TestPlain.test_graph.txt").read_text()
    run(forks, pytester, "-q", "-p", "no:cacheprovider").assert_outcomes(passed=3)


def test_a_golden_recorded_before_class_names_is_still_read_while_its_name_is_unambiguous(forks, pytester, monkeypatch):
    monkeypatch.delenv("GRAPHPASS_ACCEPT_GOLDEN", raising=False)
    monkeypatch.delenv("USER_MODEL_VARIANT", raising=False)
    one_class = CLASS_TESTS.split("class TestRelu")[0]  # TestPlain.test_graph only
    pytester.makepyfile(test_user=one_class)
    golden = pytester.path / "golden"
    run(forks, pytester, "-q", "-p", "no:cacheprovider", "--graphpass-accept-golden").assert_outcomes(passed=1)
    for suffix in (".txt", ".summary.json", ".meta.json"):  # as the plugin named it before
        (golden / f"TestPlain.test_graph{suffix}").rename(golden / f"test_graph{suffix}")
    run(forks, pytester, "-q", "-p", "no:cacheprovider").assert_outcomes(passed=1)
    pytester.makepyfile(test_user=CLASS_TESTS)  # now two classes (and a function) share that name: not read
    for selected in ("TestPlain", "TestRelu"):  # whatever is selected
        missing = run(forks, pytester, "-q", "-p", "no:cacheprovider", "-k", selected)
        missing.assert_outcomes(failed=1)
        missing.stdout.fnmatch_lines([f"*{selected}.test_graph.summary.json is missing*"])
