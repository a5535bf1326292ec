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
    s = parse(
        {
            "graphpass": {
                "options": {"then": "eager"},
                "tensor_capture": {
                    "modules": ["model.layers.0-1"],
                    "capture_dir": str(tmp_path / "c"),
                    "capture_filter": ["model.layers.1"],
                },
            }
        }
    )
    assert s.options == {"then": "eager"}
    assert s.tensor_capture.modules == ("model.layers.0-1",)
    assert s.tensor_capture.capture_filter == ("model.layers.1",)
    assert s.tensor_capture.capture_dir == str(tmp_path / "c")
    assert s.tensor_capture.draft_modules is None
    s = parse(
        {"graphpass": {"tensor_capture": {"modules": ["a"], "capture_dir": "c", "draft_modules": ["model.norm"]}}}
    )
    assert s.tensor_capture.draft_modules == ("model.norm",)


def test_a_relative_capture_dir_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = parse({"graphpass": {"tensor_capture": {"modules": ["a"], "capture_dir": "caps"}}})
    assert s.tensor_capture.capture_dir == str(tmp_path / "caps")


@pytest.mark.parametrize(
    "settings, key, words",
    [
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
    ],
)
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
        input_batch=SimpleNamespace(
            num_reqs=len(req_ids),
            req_ids=list(req_ids) + [None],
            num_computed_tokens_cpu=np.array(computed + [0]),
            num_prompt_tokens=np.array(prompt + [0]),
        ),
        query_start_loc=SimpleNamespace(cpu=torch.tensor(list(starts) + [starts[-1]], dtype=torch.int32)),
    )


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


@pytest.mark.parametrize(
    "spec, words",
    [(None, "no speculative_config"), (SimpleNamespace(method="ngram"), "method 'ngram', which runs no model")],
)
def test_draft_modules_need_a_draft_model(spec, words):
    from graphpass.integrations.vllm import _check_draft

    with pytest.raises(ConfigError) as info:
        _check_draft(spec, ("model.layers.0",))
    assert "tensor_capture.draft_modules" in str(info.value) and words in str(info.value)
    _check_draft(SimpleNamespace(method="draft_model"), ("model.layers.0",))  # accepted


def test_a_capture_dir_whose_parent_is_a_file_is_refused_before_serving(tmp_path):
    """Issue 36, item 7: the workers would make the folder only when the model is loaded; the caller can tell now."""
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError, match="tensor_capture.capture_dir.*is a file, not a folder"):
        parse({"graphpass": {"tensor_capture": {"modules": ["a"], "capture_dir": str(tmp_path / "a-file" / "caps")}}})
    parse({"graphpass": {"tensor_capture": {"modules": ["a"], "capture_dir": str(tmp_path / "new" / "caps")}}})


def test_the_report_path_must_be_absolute():
    with pytest.raises(ConfigError, match="additional_config.graphpass.report"):
        parse({"graphpass": {"report": "relative.json"}})
    assert parse({"graphpass": {"report": "/tmp/x.json"}}).report == "/tmp/x.json"


@pytest.mark.parametrize(
    "section, key, path",
    [
        ("tensor_capture", "modules", "additional_config.graphpass.tensor_capture.modules"),
        ("tensor_capture", "capture_filter", "additional_config.graphpass.tensor_capture.capture_filter"),
        ("draft", "modules", "additional_config.graphpass.tensor_capture.draft_modules"),
        ("options", "traps", "additional_config.graphpass.options.traps"),
    ],
)
def test_a_workers_error_reaches_the_caller_as_its_class_naming_the_setting(tmp_path, section, key, path):
    """Issue 36, item 7 / acceptance 4: what only a worker can check (its model's module names) is written to the
    engine's report file in config terms, and the caller raises the same class from vLLM's own error."""
    from graphpass.errors import PatternMatchError, surface
    from graphpass.integrations.vllm.worker_errors import raise_reported, reported

    report = str(tmp_path / "engine.error.json")
    config = SimpleNamespace(additional_config={"graphpass": {"report": report}})
    err = PatternMatchError(key, ["model.layers.9"], "matches no module of the model (some module names: model)")
    with pytest.raises(RuntimeError, match="vLLM's wrapper"):  # the worker's own error goes on as it was
        with reported(config, section):
            raise RuntimeError("vLLM's wrapper") from surface(err)
    vllm_error = RuntimeError("Engine core initialization failed. See root cause above.")
    with pytest.raises(PatternMatchError) as info:
        raise_reported(config, vllm_error)
    assert info.value.key == path and path in str(info.value) and "matches no module" in str(info.value)
    assert info.value.__cause__ is vllm_error
    assert not (tmp_path / "engine.error.json").exists()  # read once, removed
    raise_reported(config, vllm_error)  # nothing reported: vLLM's error goes on


def test_a_serving_error_names_the_worker_and_the_setting_and_the_first_report_is_kept(tmp_path):
    from graphpass.errors import CaptureError, GraphpassError
    from graphpass.integrations.vllm.worker_errors import raise_reported, reported, write_report

    report = tmp_path / "engine.error.json"
    config = SimpleNamespace(additional_config={"graphpass": {"report": str(report)}})
    with pytest.raises(CaptureError), reported(config, "tensor_capture"):
        raise CaptureError("cannot write step prefill_s8_0: [Errno 28] No space left on device")
    write_report(str(report), GraphpassError("a later consequence"))  # the first report is kept
    with pytest.raises(CaptureError, match=r"No space left.*vLLM worker.*additional_config.graphpass.tensor_capture"):
        raise_reported(config, RuntimeError("EngineDeadError"))
    # a planted file naming a class graphpass.errors lacks is a plain GraphpassError: never unpickled or imported
    report.write_text('{"class": "SystemExit", "message": "planted"}')
    with pytest.raises(GraphpassError, match="planted") as info:
        raise_reported(config, RuntimeError("x"))
    assert type(info.value) is GraphpassError


def test_positions_served_from_the_prefix_cache_are_read_from_the_scheduler_output():
    from graphpass.integrations.vllm.steps import prefix_cached

    out = SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id="2-ab", num_computed_tokens=16),
            SimpleNamespace(req_id="3-cd", num_computed_tokens=0),
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=["0-ef", "1-gh"], resumed_req_ids={"1-gh"}, num_computed_tokens=[40, 32]
        ),
    )
    # new requests with a cache hit, and a request resumed after a preemption; a running request is no news
    assert prefix_cached(out) == {"2-ab": 16, "1-gh": 32}
    assert prefix_cached(None) == {}


@pytest.mark.parametrize(
    "req_id, parent",
    [
        ("0_14-1a2b3c4d", "14"),
        ("1_cmpl-abc-1a2b3c4d", "cmpl-abc"),
        ("3_7", "7"),
        ("14-1a2b3c4d", None),
        ("a_14-1a2b3c4d", None),
        ("_14-x", None),
    ],
)
def test_a_parallel_sampling_child_names_its_parent(req_id, parent):
    from graphpass.integrations.vllm.steps import parent_of

    assert parent_of(req_id) == parent


def test_the_plugins_entry_point_imports_nothing_of_graphpass():
    """Issue 36, item 9: vLLM loads its plugins in every process (caller, engine core, each worker), with or without
    graphpass in the engine's config; importing any module of the graphpass package loads the compiler (seconds in
    each process). The entry point is a module outside the package that imports none of it."""
    import subprocess
    import sys

    code = (
        "import sys, graphpass_vllm_plugin as p; "
        "assert p.configured({'graphpass': {}}) and not p.configured({}) and not p.configured(None); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'graphpass'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
