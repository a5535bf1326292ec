"""graphpass.explain, the graphpass command, packaging."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import graphpass
from graphpass.cli import main
from graphpass.models.corpus import build
from graphpass.torch_compat import dynamo_compiles_own_frame

from helpers import CountingBackend, register_temp_backend

ROOT = Path(__file__).resolve().parents[2]


def test_explain_returns_objects_and_compiles_nothing(monkeypatch):
    counter = register_temp_backend(monkeypatch, "counting_delegate", CountingBackend())
    model, inputs = build("tiny_transformer")
    report = graphpass.explain(model, *inputs, then="counting_delegate")
    assert counter.calls == 0
    rows = report.trap_rows()
    assert [r.label for r in rows] == ["layers.0", "layers.1"]
    r0 = rows[0]
    assert r0.tensors == 6 and r0.first_node and r0.last_node
    assert "layers.0.attn.qkv.weight" in r0.fqns
    assert r0.nbytes == sum(p.numel() * 4 for p in model.layers[0].parameters())
    text = str(report)
    for col in ("trap", "tensors", "bytes", "first node", "last node", "owning FQNs"):
        assert col in text
    assert "layers.1" in text
    data = report.to_dict()
    json.dumps(data)
    assert data["total_weight_bytes"] == report.total_weight_bytes


def test_explain_takes_options():
    model, inputs = build("mlp_stack")
    report = graphpass.explain(model, *inputs, traps=["head"])
    assert list(report.traps) == ["head"]
    with pytest.raises(graphpass.PatternMatchError):
        graphpass.explain(model, *inputs, traps=["nothing_here"])


def test_cli_explain(capsys):
    assert main(["explain", "graphpass.models.corpus:moe"]) == 0
    out = capsys.readouterr().out
    assert "layers.0" in out and "layers.0.moe.w13_weight" in out
    assert main(["explain", "graphpass.models.corpus:quant_linear", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert any(t["kind"] == "inner" for t in data["tensors"])


def test_cli_errors_are_clear(capsys):
    assert main(["explain", "graphpass.models.corpus:mlp_stack", "--traps", "layers.4-1"]) == 2
    assert "layers.4-1" in capsys.readouterr().err
    assert main(["explain", "no_such_module_xyz:f"]) == 2
    assert main(["explain", "graphpass.models.corpus"]) == 2


def test_cli_demo_with_disk_offload(capsys):
    assert main(["demo", "--then", "aot_eager", "--offload", "disk"]) == 0
    out = capsys.readouterr().out
    assert "storage='disk'" in out and "offload plan" in out and "peak streamed bytes" in out and "-> OK" in out


def test_cli_demo_with_eager_delegate(capsys):
    assert main(["demo", "--then", "aot_eager"]) == 0
    out = capsys.readouterr().out
    assert "layers.3" in out and "OK" in out
    # where to look next: the docs, explain, trace
    assert all(w in out for w in ("docs/index.md", "graphpass explain", "graphpass trace", "docs/trace.md"))


def _clean_env():
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def test_fresh_interpreter_lists_graphpass_without_importing_it(tmp_path):
    code = (
        "import sys, torch._dynamo\n"
        "names = torch._dynamo.list_backends()\n"
        "print('graphpass' in names, 'graphpass' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["True", "False"]


def test_compile_by_name_in_fresh_interpreter(tmp_path):
    code = (
        "import torch\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))\n"
        "x = torch.randn(2, 4)\n"
        "out = torch.compile(m, backend='graphpass', options={'then': 'eager'})(x)\n"
        "print(torch.equal(out, m(x)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "True"


def test_backends_installs_only_as_graphpass_backends(tmp_path):
    code = "import importlib.util as u; print(u.find_spec('backends') is None, u.find_spec('graphpass.backends') is not None)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["True", "True"]


def test_console_script_runs(tmp_path):
    exe = Path(sys.executable).parent / "graphpass"
    out = subprocess.run([str(exe), "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0 and "explain" in out.stdout and "demo" in out.stdout


def test_pyproject_declares_what_the_issue_lists():
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = " ".join(data["project"]["dependencies"])
    for dep in ("torch>=2.9", "sympy", "tabulate", "safetensors"):
        assert dep in deps
    assert (
        data["project"]["entry-points"]["torch_dynamo_backends"]["graphpass"]
        == "graphpass.dynamo_backend:graphpass_backend"
    )
    assert data["project"]["scripts"]["graphpass"] == "graphpass.cli:main"
    assert data["tool"]["setuptools"]["package-dir"]["graphpass.backends"] == "backends"
    assert {"pytest", "expecttest"} <= set(data["project"]["optional-dependencies"]["test"])
    readme = (ROOT / "README.md").read_text()
    first = readme[: readme.index("make test") + 20]
    assert "make demo" in first
    assert "make test" in (ROOT / ".ci" / "run").read_text()


class _Chatty(torch.nn.Module):
    """A graph break inside the layer loop: Dynamo skips the frame with the loop."""

    def __init__(self, n):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
            torch._dynamo.graph_break()  # a break inside the loop
        return x


def test_explain_says_when_dynamo_skipped_the_frame():
    """A graph break inside the layer loop makes Dynamo skip the frame: explain used to print
    "0 graph(s)" and nothing else; it now says what happened, in Dynamo's words, and what to do."""

    report = graphpass.explain(_Chatty(3), torch.randn(2, 8))
    text = str(report)
    assert "0 graph(s)" in text
    assert "Dynamo compiled no graph for this call" in text and "skipped the whole frame" in text
    assert "What to do" in text and "layer loop" in text


@pytest.mark.skipif(
    not dynamo_compiles_own_frame(torch.nn.Linear),
    reason=f"torch {torch.__version__}'s Dynamo "
    "compiles no frame of its own for nn.Linear.forward called eagerly: the layers cannot stream "
    "(test_inbuilt_layers_a_skipped_frame_calls_run_eagerly_and_say_so checks what happens instead)",
)
def test_offloaded_model_whose_frame_dynamo_skipped():
    """Dynamo skips the frame with the layer loop and compiles each layer's call on its own: the
    hooks' graph (the offload guard alone) and the layer's forward (its loads) are two graphs. The
    model still streams and matches eager; a guard that does run eagerly says what Dynamo skipped."""

    torch.manual_seed(0)
    model = _Chatty(2).eval().requires_grad_(False)
    x = torch.randn(2, 8)
    ref = model(x)
    graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="cpu"))
    compiled = torch.compile(model, backend=graphpass.backend(then="eager"))
    with torch.no_grad():
        assert torch.equal(compiled(x), ref)
    assert graphpass.memory_stats(model).groups_loaded == 2
    with pytest.raises(
        graphpass.OffloadError, match=r"(?s)ran outside a graph.*Dynamo skipped the whole frame.*What to do"
    ):
        torch.ops.graphpass.offload_guard("layers.0")  # as when a hook runs eagerly


@pytest.mark.skipif(
    dynamo_compiles_own_frame(torch.nn.Linear), reason="this torch compiles the layers' forward on its own"
)
def test_inbuilt_layers_a_skipped_frame_calls_run_eagerly_and_say_so():
    """torch 2.9: the layers (nn.Linear, in Dynamo's skip list) that the skipped frame calls run
    eagerly; only their hooks are a graph. That used to pass silently (with device stand-ins, a wrong
    result): with host copies it is a warning naming the module, with stand-ins a refusal."""
    from graphpass.offloading.install import device_stand_ins_on_host

    torch.manual_seed(0)
    model = _Chatty(2).eval().requires_grad_(False)
    x = torch.randn(2, 8)
    ref = model(x)
    graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="cpu"))
    compiled = torch.compile(model, backend=graphpass.backend(then="eager"))
    with (
        torch.no_grad(),
        pytest.warns(
            UserWarning,
            match=r"module 'layers.0' \(Linear\).*called from code running "
            r"eagerly.*not streamed \(results are right",
        ),
    ):
        assert torch.equal(compiled(x), ref)
    torch._dynamo.reset()
    model = _Chatty(2).eval().requires_grad_(False)
    with device_stand_ins_on_host():
        graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="cpu"))
    compiled = torch.compile(model, backend=graphpass.backend(then="eager"))
    with (
        torch.no_grad(),
        pytest.raises(
            graphpass.OffloadError,
            match=r"module 'layers.0' \(Linear\).*reads the "
            r"device stand-ins.*exclude_patterns=\['layers.0'\]",
        ),
    ):
        compiled(x)
