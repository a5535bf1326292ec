"""Serving scenarios of the vLLM leg's fault suite (test_serving_faults_vllm.py), each in a process of its own.

``python serve_faults.py SCENARIO SPEC_JSON``; SPEC: model, settings (``additional_config["graphpass"]``), prompts,
max_new_tokens, result (path), and per scenario:

- ``serve``: one engine serves the prompts; an exception of ``generate()`` is recorded (class, its classes, message,
  the class of its cause) instead of ending the process, so the test sees what the caller got;
- ``engines``: two graphpass engines alive in this process at once (settings, and settings_b), each serving the
  prompts; then both shut down, and a third engine without graphpass serves them.
"""

import gc
import json
import os
import sys

DEFAULTS = dict(
    skip_tokenizer_init=True, dtype="float32", max_model_len=128, max_num_seqs=4, gpu_memory_utilization=0.3
)


def _generate(llm, spec):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=spec["max_new_tokens"], temperature=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def _error(exc):
    return {
        "class": type(exc).__name__,
        "classes": [c.__module__ + "." + c.__name__ for c in type(exc).__mro__],
        "message": str(exc),
        "cause": type(exc.__cause__).__name__ if exc.__cause__ else None,
    }


def serve(spec):
    from vllm import LLM

    extra = {"additional_config": {"graphpass": spec["settings"]}} if spec.get("settings") is not None else {}
    llm = LLM(model=spec["model"], **extra, **DEFAULTS)
    try:
        return {"tokens": _generate(llm, spec)}
    except Exception as exc:  # what the caller gets: the test checks it
        return {"error": _error(exc)}


def engines(spec):
    from vllm import LLM

    a = LLM(model=spec["model"], additional_config={"graphpass": spec["settings"]}, **DEFAULTS)
    b = LLM(model=spec["model"], additional_config={"graphpass": spec["settings_b"]}, **DEFAULTS)
    result = {
        "a": _generate(a, spec),
        "b": _generate(b, spec),
        "stats": [a.collective_rpc("graphpass_stats"), b.collective_rpc("graphpass_stats")],
    }
    result["a_again"] = _generate(a, spec)  # the first engine still serves after the second started
    for llm in (a, b):
        llm.llm_engine.engine_core.shutdown()
    del a, b
    gc.collect()
    plain = LLM(model=spec["model"], **DEFAULTS)  # an engine without graphpass, after graphpass ones
    config = plain.llm_engine.vllm_config
    result["plain"] = {
        "tokens": _generate(plain, spec),
        "worker_cls": config.parallel_config.worker_cls,
        "backend": config.compilation_config.backend,
        "mode": int(config.compilation_config.mode),
        "additional_config": config.additional_config,
        "compile_cache_env": os.environ.get("VLLM_DISABLE_COMPILE_CACHE"),
    }
    try:
        plain.collective_rpc("graphpass_stats")
        result["plain"]["graphpass_worker"] = True
    except Exception:  # vLLM's own worker has no graphpass_stats
        result["plain"]["graphpass_worker"] = False
    return result


if __name__ == "__main__":
    scenario, spec = sys.argv[1], json.loads(sys.argv[2])
    result = {"serve": serve, "engines": engines}[scenario](spec)
    with open(spec["result"], "w") as f:
        json.dump(result, f)
