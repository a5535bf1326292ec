"""graphpass's vLLM plugin in vLLM's default (multiprocess) CPU engine: settings checked before serving,
one capture step per engine step with its meta, no warm-up step, no recompilation, and the captured
decoder-layer outputs (hidden + residual) equal to transformers' eager ones at every request and position."""

import importlib.metadata
import json
import os

import pytest

pytest.importorskip("vllm.config")  # vLLM itself, not a folder named vllm on sys.path

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from graphpass.errors import ConfigError  # noqa: E402

from vllm_serving import LLM_DEFAULTS, MAX_NEW_TOKENS, PROMPTS, serve, write_tiny_llama  # noqa: E402

MODULES = ["model.layers.0", "model.layers.1"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_the_plugin_is_registered_with_vllm():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert "graphpass_vllm_plugin:register" in [e.value for e in eps]


A_FILE = os.path.abspath(__file__)


@pytest.mark.parametrize(
    "settings, key, words, llm_kwargs",
    [
        ({"tensor_capture": {"modules": "model.layers.0", "capture_dir": "x"}}, "tensor_capture.modules", "list", {}),
        ({"tensor_capture": {"modules": ["model.layers.0"]}}, "tensor_capture.capture_dir", "folder", {}),
        (
            {"tensor_capture": {"modules": ["model.layers.0"], "capture_dir": A_FILE}},
            "tensor_capture.capture_dir",
            "is a file",
            {},
        ),
        ({"offload": {"device": "cpu"}}, "offload", "packed oneDNN weights", {}),
        # the draft model of speculative decoding: this engine has no speculative_config
        (
            {
                "tensor_capture": {
                    "modules": ["model.layers.0"],
                    "capture_dir": "x",
                    "draft_modules": ["model.layers.0"],
                }
            },
            "tensor_capture.draft_modules",
            "no speculative_config",
            {},
        ),
        ({"options": {"then": "no-such-delegate"}}, "then", "", {}),
        ({"tracing": True}, "additional_config.graphpass", "unknown keys", {}),
        # compilation turned off: named as the vLLM setting at fault, not as 'additional_config.graphpass'
        ({"options": {"then": "eager"}}, "enforce_eager", "turns compilation off", {"enforce_eager": True}),
        # found by the plugin inside vLLM's (pydantic) config: graphpass's ConfigError, not a ValidationError
        (
            {"options": {"then": "eager"}},
            "compilation_config.mode",
            "compilation is off",
            {"compilation_config": {"mode": 0}},
        ),
        # a folder the workers could not make
        (
            {"tensor_capture": {"modules": ["model.layers.0"], "capture_dir": A_FILE + "/caps"}},
            "tensor_capture.capture_dir",
            "is a file, not a folder",
            {},
        ),
    ],
)
def test_bad_settings_are_refused_before_serving(tiny_llama, settings, key, words, llm_kwargs):
    """Issue 36, item 6: the caller gets graphpass's ConfigError itself (checked when its EngineArgs make the
    config, before vLLM's pydantic config could wrap it into a ValidationError), naming the setting."""
    from vllm import LLM

    with pytest.raises(ConfigError) as info:
        LLM(
            model=str(tiny_llama),
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=128,
            additional_config={"graphpass": settings},
            **llm_kwargs,
        )
    text = str(info.value)
    assert key in text and words in text, text


@pytest.mark.parametrize(
    "settings, key, error",
    [
        (
            {"tensor_capture": {"modules": ["model.layers.9"]}},
            "additional_config.graphpass.tensor_capture.modules",
            "PatternMatchError",
        ),
        (
            {"tensor_capture": {"modules": ["model.layers.0-1"], "capture_filter": ["model.layers.7"]}},
            "additional_config.graphpass.tensor_capture.capture_filter",
            "PatternMatchError",
        ),
        ({"options": {"traps": ["model.blocks.*"]}}, "additional_config.graphpass.options.traps", "PatternMatchError"),
    ],
)
def test_settings_only_a_worker_can_check_reach_the_caller_naming_their_path(
    tiny_llama, tmp_path, settings, key, error
):
    """Issue 36, item 7 and acceptance 4: the served model's module names are known only in the worker (vLLM
    builds the model there), so patterns that match none of them stop the engine there. The caller gets
    graphpass's error itself, of its class and naming the setting's path in additional_config, from vLLM's
    'Engine core initialization failed' (not only that, with the reason in a worker's log)."""
    from vllm import LLM

    from graphpass.errors import GraphpassError

    settings = {**settings, "options": {"then": "eager", **settings.get("options", {})}}
    if "tensor_capture" in settings:
        settings["tensor_capture"] = {**settings["tensor_capture"], "capture_dir": str(tmp_path / "caps")}
    with pytest.raises(GraphpassError) as info:
        LLM(model=str(tiny_llama), **LLM_DEFAULTS, additional_config={"graphpass": settings})
    assert type(info.value).__name__ == error and info.value.key == key, repr(info.value)
    assert key in str(info.value) and "matches no module" in str(info.value)
    assert "initialization failed" in str(info.value.__cause__)  # vLLM's own error, kept as the cause


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("served")
    caps = out / "caps"
    settings = {"options": {"then": "eager"}, "tensor_capture": {"modules": MODULES, "capture_dir": str(caps)}}
    return serve(tiny_llama, out, settings), caps


def _metas(caps):
    metas = [json.loads(p.read_text()) for p in (caps / "dp0").glob("*/*_meta.json")]
    return sorted(metas, key=lambda m: m["step_index"])


def _req(rid: str) -> str:
    """vLLM's internal request id is the caller's plus ``-<suffix>``."""
    return rid.rsplit("-", 1)[0]


def test_each_engine_step_is_one_step_named_by_its_phase(served):
    result, caps = served
    metas = _metas(served[1])
    assert [m["step_index"] for m in metas] == list(range(len(metas)))
    # the first engine step is a prefill of real requests from their first token: no warm-up or profile
    # step (which prompts vLLM batches into it depends on when they arrive)
    first = metas[0]
    assert first["step"] == f"prefill_s{len(first['positions'])}_0"
    assert {_req(r) for r in first["req_ids"]} <= set(result["request_ids"])
    assert all(
        min(p for i, p in zip(first["token_request"], first["positions"]) if i == k) == 0
        for k in range(len(first["req_ids"]))
    )
    for m in metas:
        n = len(m["positions"])
        assert len(m["token_request"]) == n
        if m["phase"] == "decode":
            assert m["step"].startswith(f"decode_b{len(m['req_ids'])}_") and n == len(m["req_ids"])
        else:
            assert m["step"].startswith(f"prefill_s{n}_")
        assert m["modules"] == MODULES and m["tp_rank"] == 0 and m["dp_rank"] == 0
        for mod in MODULES:
            assert (caps / "dp0" / m["step"] / mod / "rank0.safetensors").is_file()
            assert [t["shape"][0] for t in m["tensors"][mod]] == [n, n]  # (hidden, residual) per token


def test_every_token_of_every_request_is_captured_once(served):
    result, caps = served
    seen = {}
    for m in _metas(caps):
        for i, pos in zip(m["token_request"], m["positions"]):
            seen.setdefault(_req(m["req_ids"][i]), []).append(pos)
    # a request's last generated token is never fed back: prompt + max_new_tokens - 1 positions
    want = {rid: list(range(len(p) + MAX_NEW_TOKENS - 1)) for rid, p in zip(result["request_ids"], PROMPTS)}
    assert {r: sorted(v) for r, v in seen.items()} == want


def test_every_step_names_the_engines_run_and_a_used_capture_dir_is_refused_before_serving(served, tiny_llama):
    """Issue 36, items 1 and 2: one run id for the engine in every step's meta; a second engine given the same
    capture_dir is refused in the caller, before serving, with graphpass's ConfigError naming the run it holds
    (not vLLM's EngineDeadError with the reason only in a worker's log)."""
    from vllm import LLM

    _, caps = served
    runs = {m["run"] for m in _metas(caps)}
    assert len(runs) == 1 and all(isinstance(r, str) and r for r in runs), runs
    with pytest.raises(ConfigError, match="holds the captures of another run") as info:
        LLM(
            model=str(tiny_llama),
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=128,
            additional_config={"graphpass": {"tensor_capture": {"modules": MODULES, "capture_dir": str(caps)}}},
        )
    assert next(iter(runs)) in str(info.value) and "tensor_capture.capture_dir" in str(info.value)


def test_the_compile_cache_is_off_in_the_workers_only(served):
    """Issue 36, item 8: the workers run with vLLM's compile cache off (a cached graph never reaches graphpass),
    and the caller's environment is left as it was, so a later plain engine there keeps its cache."""
    result, _ = served
    assert all(s["compile_cache_disabled"] for s in result["stats_before"] + result["stats_after"])
    assert result["caller_compile_cache_env"] is None


def test_capture_causes_no_recompilation(served):
    result, _ = served
    before, after = result["stats_before"][0], result["stats_after"][0]
    assert before["capture_enabled"] and after["capture_enabled"]
    assert before["unique_graphs"] >= 1
    assert after["unique_graphs"] == before["unique_graphs"]


def _hf_layer_outputs(model_dir, tokens):
    """transformers, eager, fp32: each decoder layer's output for the whole sequence ``tokens``."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    outs = {}
    hooks = [
        model.model.layers[i].register_forward_hook(
            lambda mod, a, o, i=i: outs.__setitem__(f"model.layers.{i}", (o[0] if isinstance(o, tuple) else o)[0])
        )
        for i in range(len(model.model.layers))
    ]
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    return outs


def _hf_greedy(model_dir, prompt, n):
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_tokens_and_layer_outputs_equal_transformers_eager(served, tiny_llama):
    result, caps = served
    for prompt, tokens in zip(PROMPTS, result["tokens"]):
        assert tokens == _hf_greedy(tiny_llama, prompt, MAX_NEW_TOKENS)
    ref = {
        rid: _hf_layer_outputs(tiny_llama, p + t[:-1])
        for rid, p, t in zip(result["request_ids"], PROMPTS, result["tokens"])
    }
    compared = 0
    for m in _metas(caps):
        for mod in MODULES:
            t = load_file(caps / "dp0" / m["step"] / mod / "rank0.safetensors")
            layer_out = t["[0]"] + t["[1]"]  # vLLM's layer returns (hidden, residual): the output is their sum
            for row, (i, pos) in enumerate(zip(m["token_request"], m["positions"])):
                want = ref[_req(m["req_ids"][i])][mod][pos]
                torch.testing.assert_close(layer_out[row], want, rtol=1e-4, atol=1e-4)
                compared += 1
    assert compared == 2 * sum(len(p) + MAX_NEW_TOKENS - 1 for p in PROMPTS)


LOAD_PLUGINS = """
import json, sys, time
import vllm
from vllm.engine.arg_utils import EngineArgs
t = time.perf_counter()
from vllm.plugins import load_general_plugins
load_general_plugins()
loaded = time.perf_counter() - t
settings = json.loads(sys.argv[2])
extra = {"additional_config": {"graphpass": settings}} if settings is not None else {}
EngineArgs(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=128, **extra).create_engine_config()
print(json.dumps({"seconds": loaded, "plugin": "graphpass_vllm_plugin" in sys.modules,
                  "graphpass": sorted(m for m in sys.modules if m.split(".")[0] == "graphpass")}))
"""


def test_without_a_graphpass_config_the_plugin_loads_no_graphpass_module(tiny_llama):
    """Issue 36, item 9: with graphpass installed and no graphpass config, vLLM's plugin loading and an engine's
    config import nothing of the graphpass package (it cost each vLLM process 0.3 s, or 2.8 s where vLLM's
    arg_utils was not loaded yet); an engine with graphpass gets the plugin."""
    import subprocess
    import sys

    def run(settings):
        env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
        out = subprocess.run(
            [sys.executable, "-c", LOAD_PLUGINS, str(tiny_llama), json.dumps(settings)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-4000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    plain = run(None)
    print(f"vLLM's general plugins loaded in {plain['seconds']:.4f} s")
    assert plain["plugin"] and plain["graphpass"] == [], plain  # the entry point ran; nothing of the package
    with_graphpass = run({"options": {"then": "eager"}})
    assert "graphpass.integrations.vllm" in with_graphpass["graphpass"], with_graphpass
