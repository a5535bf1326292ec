"""The focused inductor set: real inductor compilation end to end (slow on CPU, ~20 s a model).

Tolerances: inductor reorders and fuses float math, so fp32 outputs are compared with
rtol=1e-4, atol=1e-5 and gradients with rtol=1e-4, atol=1e-5 (eager-delegate tests are exact).
"""

import pytest
import torch

import graphpass
from graphpass.cli import main
from graphpass.models.corpus import build

from helpers import fresh_inputs

pytestmark = pytest.mark.inductor


def test_training_with_inductor_matches_eager_gradients():
    model, inputs = build("tiny_transformer")
    ref, _ = build("tiny_transformer")
    ref.load_state_dict(model.state_dict())
    x = fresh_inputs(inputs)
    compiled = torch.compile(model, backend="graphpass")
    with graphpass.trace_traps() as events:
        loss = compiled(*x).square().mean()
    loss.backward()
    ref_loss = ref(*x).square().mean()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-5, msg=n)
    assert ("enter", "layers.1") in events


def test_graph_break_and_dynamic_with_inductor():
    model, inputs = build("graph_break")
    compiled = torch.compile(model, backend="graphpass", dynamic=True)
    for rows in (3, 5):
        x = torch.randn(rows, 32)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_make_demo_path(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "-> OK" in out and "layers.3" in out and "delegate inductor" in out
