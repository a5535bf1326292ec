"""The vLLM plugin's parts that need no vLLM (the main leg): its settings, refused with the key at fault
before serving, and an engine step's name and meta from a model runner's batch. The plugin inside vLLM
itself: tests/in_vllm (the vLLM leg, make test-vllm)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from graphpass.errors import ConfigError
from graphpass.integrations.vllm.config import parse
from graphpass.integrations.vllm.steps import draft_step, engine_step


def test_no_graphpass_key_changes_nothing():
    assert parse({}) is None and parse({"other": 1}) is None and parse(None) is None


def test_settings_are_read(tmp_path):
    s = parse({"graphpass": {"options": {"then": "eager"},
                             "tensor_capture": {"modules": ["model.layers.0-1"], "capture_dir": str(tmp_path / "c"),
                                                "capture_filter": ["model.layers.1"]}}})
    assert s.options == {"then": "eager"}
    assert s.tensor_capture.modules == ("model.layers.0-1",)
    assert s.tensor_capture.capture_filter == ("model.layers.1",)
    assert s.tensor_capture.capture_dir == str(tmp_path / "c")
    assert s.tensor_capture.draft_modules is None
    s = parse({"graphpass": {"tensor_capture": {"modules": ["a"], "capture_dir": "c", "draft_modules": ["model.norm"]}}})
    assert s.tensor_capture.draft_modules == ("model.norm",)


def test_a_relative_capture_dir_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = parse({"graphpass": {"tensor_capture": {"modules": ["a"], "capture_dir": "caps"}}})
    assert s.tensor_capture.capture_dir == str(tmp_path / "caps")


@pytest.mark.parametrize("settings, key, words", [
    ([], "additional_config.graphpass", "dict"),
    ({"tracing": 1}, "additional_config.graphpass", "unknown keys"),
    ({"tensor_capture": {"modules": "model.layers.0", "capture_dir": "x"}}, "tensor_capture.modules", "list"),
    ({"tensor_capture": {"modules": [], "capture_dir": "x"}}, "tensor_capture.modules", "non-empty"),
    ({"tensor_capture": {"modules": ["a"]}}, "tensor_capture.capture_dir", "folder"),
    ({"tensor_capture": {"modules": ["a"], "capture_dir": "x", "vision": 1}}, "tensor_capture", "unknown keys"),
    ({"tensor_capture": {"modules": ["a"], "capture_dir": "x", "draft_modules": "a"}}, "draft_modules", "list"),
    ({"offload": {"device": "cpu"}}, "offload", "packed oneDNN weights"),
    ({"options": {"then": 3}}, "then", ""),
    ({"options": "eager"}, "options", "dict"),
])
def test_bad_settings_name_the_key(settings, key, words):
    with pytest.raises(ConfigError) as info:
        parse({"graphpass": settings})
    assert key in str(info.value) and words in str(info.value)


def test_offload_refusal_names_the_reason_and_what_avoids_it():
    with pytest.raises(ConfigError) as info:
        parse({"graphpass": {"offload": {}}})
    text = str(info.value)
    assert "oneDNN" in text and "Leave 'offload' out" in text


def _runner(req_ids, scheduled, computed, prompt):
    starts = np.concatenate([[0], np.cumsum(scheduled)])
    return SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=len(req_ids), req_ids=list(req_ids) + [None],
                                    num_computed_tokens_cpu=np.array(computed + [0]),
                                    num_prompt_tokens=np.array(prompt + [0])),
        query_start_loc=SimpleNamespace(cpu=torch.tensor(list(starts) + [starts[-1]], dtype=torch.int32)))


def test_a_mixed_step_is_a_prefill_with_each_tokens_request_and_position():
    # request a decodes its 6th token while b's 3-token prompt is prefilled: one flat batch of 4 tokens
    runner = _runner(["a-1", "b-2"], [1, 3], computed=[5, 0], prompt=[5, 3])
    step = engine_step(runner, torch.tensor([5, 0, 1, 2]))
    assert step.is_prefill and step.req_ids == ["a-1", "b-2"]
    assert step.token_request == [0, 1, 1, 1] and step.positions.tolist() == [5, 0, 1, 2]


def test_a_decode_step_and_padding_tokens():
    runner = _runner(["a-1", "b-2"], [1, 1], computed=[6, 4], prompt=[5, 3])
    step = engine_step(runner, torch.tensor([6, 4, 0]))  # one padding token after the scheduled ones
    assert not step.is_prefill and step.token_request == [0, 1, -1]


def test_draft_passes_are_steps_with_each_tokens_request():
    # the draft's first pass after a prefill of a (5 tokens) and b (3): each request's tokens plus its next one
    runner = _runner(["a-1", "b-2"], [5, 3], computed=[0, 0], prompt=[5, 3])
    target = engine_step(runner, torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]))
    first = draft_step(runner, torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3]), torch.tensor([0, 6, 10]), target, 0)
    assert first.is_prefill and first.req_ids == ["a-1", "b-2"]
    assert first.token_request == [0] * 6 + [1] * 4
    # a later pass: one token per request, then padding rows
    later = draft_step(runner, torch.tensor([6, 4, 0]), torch.tensor([0, 1, 2]), target, 1)
    assert not later.is_prefill and later.token_request == [0, 1, -1]
    # without attention metadata no row is attributed to a request (compare then skips them), nothing is guessed
    assert draft_step(runner, torch.tensor([6, 4]), None, target, 1).token_request == [-1, -1]


@pytest.mark.parametrize("spec, words", [(None, "no speculative_config"),
                                         (SimpleNamespace(method="ngram"), "method 'ngram', which runs no model")])
def test_draft_modules_need_a_draft_model(spec, words):
    from graphpass.integrations.vllm import _check_draft

    with pytest.raises(ConfigError) as info:
        _check_draft(spec, ("model.layers.0",))
    assert "tensor_capture.draft_modules" in str(info.value) and words in str(info.value)
    _check_draft(SimpleNamespace(method="draft_model"), ("model.layers.0",))  # accepted
