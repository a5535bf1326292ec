"""The command line's conventions: --version, python -m graphpass, --help examples, stable JSON schemas (docs/cli.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import graphpass
from graphpass.cli import main

SUBCOMMANDS = ("demo", "explain", "audit", "compare", "trace", "reference")

EXPLAIN_KEYS = {"graphs", "total_weight_bytes", "traps", "tensors"}
EXPLAIN_TRAP_KEYS = {"graph", "label", "manual", "first_node", "last_node", "fqns", "tensors", "nbytes"}
EXPLAIN_TENSOR_KEYS = {"graph", "fqns", "kind", "dtype", "shape", "nbytes", "parent", "holders", "consumers", "traps"}
AUDIT_KEYS = {"training", "partial_factor", "graphs", "dynamic", "counts", "rows", "notes"}
AUDIT_DIM_KEYS = {"input", "dim", "example", "min", "max", "symbol", "range"}
AUDIT_ROW_KEYS = {
    "graph",
    "node",
    "op",
    "source",
    "shape",
    "bound_elems",
    "bound_bytes",
    "verdict",
    "reason",
    "rule",
    "code",
    "example_elems",
}
COMPARE_KEYS = {"ref_dir", "test_dir", "rtol", "atol", "passed", "counts", "first_failure", "summary", "notes", "rows"}
COMPARE_ROW_KEYS = {"step", "module", "rank", "key", "status", "max_abs", "rel_l2", "rel_linf", "note", "missing"}
COMPARE_COUNT_KEYS = {"total", "pass", "fail", "missing_in_test", "missing_in_ref", "missing_in_both"}


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"graphpass {graphpass.__version__}"


def test_python_dash_m_is_the_command():
    out = subprocess.run([sys.executable, "-m", "graphpass", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"graphpass {graphpass.__version__}"
    bad = subprocess.run(
        [sys.executable, "-m", "graphpass", "explain", "nomodule"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "graphpass: error: graphpass option 'factory'" in bad.stderr


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_help_has_an_example(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "example:\n  graphpass " + command in text


def test_explain_json_schema(capsys):
    assert main(["explain", "graphpass.models.corpus:tiny_transformer", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == EXPLAIN_KEYS
    assert doc["traps"] and all(set(t) == EXPLAIN_TRAP_KEYS for t in doc["traps"])
    assert doc["tensors"] and all(set(t) == EXPLAIN_TENSOR_KEYS for t in doc["tensors"])


def test_audit_json_schema(capsys):
    assert (
        main(
            [
                "audit",
                "graphpass.models.audit_example:factory",
                "--dynamic",
                "ids=1:8:512",
                "--dynamic",
                "hidden=1:8:512",
                "--dynamic",
                "loss_mask=1:8:512",
                "--inference",
                "--json",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == AUDIT_KEYS
    assert set(doc["counts"]) == {"YES", "PARTIAL", "NO"}
    assert doc["dynamic"] and all(set(d) == AUDIT_DIM_KEYS for d in doc["dynamic"])
    assert doc["rows"] and all(set(r) == AUDIT_ROW_KEYS for r in doc["rows"])


def test_compare_json_schema(tmp_path, capsys):
    from safetensors.torch import save_file

    for side, value in (("ref", 1.0), ("test", 1.5)):
        step = tmp_path / side / "dp0" / "prefill_s4_0"
        (step / "layers.0").mkdir(parents=True)
        save_file({"0": torch.full((4,), value)}, str(step / "layers.0" / "rank0.safetensors"))
        (step / "prefill_s4_0_meta.json").write_text(json.dumps({"modules": ["layers.0"]}))
    summary = tmp_path / "summary.json"
    code = main(["compare", str(tmp_path / "ref"), str(tmp_path / "test"), "--json", str(summary)])
    doc = json.loads(summary.read_text())
    assert set(doc) == COMPARE_KEYS
    assert set(doc["counts"]) == COMPARE_COUNT_KEYS
    assert doc["rows"] and all(set(r) == COMPARE_ROW_KEYS for r in doc["rows"])
    assert code == 1 and doc["passed"] is False and set(doc["first_failure"]) == COMPARE_ROW_KEYS
