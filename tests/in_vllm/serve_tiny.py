"""Serve token prompts with vLLM (``LLM``, the default multiprocess engine) and the graphpass plugin.

``python serve_tiny.py SPEC_JSON``; SPEC: model, settings (``additional_config["graphpass"]``), prompts
(token-id lists), max_new_tokens, result (path), optionally profile_dir (vLLM's torch profiler writes its
trace there, around ``generate``) and llm_kwargs (more keyword arguments of ``LLM``:
``tensor_parallel_size``, ``speculative_config``), rounds (instead of prompts: ``[{"prompts": [...], "n": 2}, ...]``,
one ``generate()`` after the other, each with its own parallel sampling ``n``). Writes the result: tokens and request ids per prompt,
and the worker's ``graphpass_stats`` after start-up and after serving.
"""

import json
import os
import sys


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    profile = {}
    if spec.get("profile_dir"):
        profile = {
            "profiler_config": {
                "profiler": "torch",
                "torch_profiler_dir": spec["profile_dir"],
                "torch_profiler_use_gzip": False,
                "torch_profiler_with_stack": False,
            }
        }
    kwargs = dict(
        skip_tokenizer_init=True, dtype="float32", max_model_len=128, max_num_seqs=4, gpu_memory_utilization=0.5
    )  # vllm_serving.LLM_DEFAULTS: other load on the machine would stop it
    kwargs.update(spec.get("llm_kwargs") or {})
    llm = LLM(model=spec["model"], additional_config={"graphpass": spec["settings"]}, **profile, **kwargs)
    before = llm.collective_rpc("graphpass_stats")
    if profile:
        llm.start_profile()
    outs = []
    # rounds: one generate() after the other (a later round's prompts can hit the prefix cache of an earlier one's),
    # each with its own n (parallel sampling); without rounds, one generate() of all the prompts
    for r in spec.get("rounds") or [{"prompts": spec["prompts"], "n": 1}]:
        n = r.get("n", 1)
        # vLLM refuses n > 1 with greedy sampling (temperature 0): top_k=1 samples the greedy token all the same
        sampling = {"temperature": 0} if n == 1 else {"temperature": 1.0, "top_k": 1, "seed": 0}
        params = SamplingParams(max_tokens=spec["max_new_tokens"], detokenize=False, n=n, **sampling)
        outs += llm.generate([{"prompt_token_ids": p} for p in r["prompts"]], params)
    if profile:
        llm.stop_profile()
    after = llm.collective_rpc("graphpass_stats")
    cache = llm.llm_engine.vllm_config.cache_config
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "samples": [[list(c.token_ids) for c in o.outputs] for o in outs],
        "request_ids": [o.request_id for o in outs],
        "stats_before": before,
        "stats_after": after,
        "block_size": cache.block_size,
        "prefix_caching": bool(cache.enable_prefix_caching),
        # what the engine left in this (the caller's) process's environment
        "caller_compile_cache_env": os.environ.get("VLLM_DISABLE_COMPILE_CACHE"),
    }
    with open(spec["result"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
