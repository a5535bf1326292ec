"""Serve token prompts with vLLM (``LLM``, the default multiprocess engine) and the graphpass plugin.

``python serve_tiny.py SPEC_JSON``; SPEC: model, settings (``additional_config["graphpass"]``), prompts
(token-id lists), max_new_tokens, result (path). Writes the result: tokens and request ids per prompt,
and the worker's ``graphpass_stats`` after start-up and after serving.
"""

import json
import sys


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="float32", max_model_len=128, max_num_seqs=4,
              additional_config={"graphpass": spec["settings"]})
    before = llm.collective_rpc("graphpass_stats")
    params = SamplingParams(max_tokens=spec["max_new_tokens"], temperature=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params)
    after = llm.collective_rpc("graphpass_stats")
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
              "request_ids": [o.request_id for o in outs], "stats_before": before, "stats_after": after}
    with open(spec["result"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
