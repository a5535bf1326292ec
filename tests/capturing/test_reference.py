"""``graphpass reference``: transformers, eager, greedy, one request per prompt, captured per step in the
layout an engine's captures use, and REF/tokens.json."""

import json

import pytest
import torch
from safetensors.torch import load_file

from graphpass.cli import main
from graphpass.errors import ConfigError
from graphpass.reference import read_prompts

transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_reference_writes_steps_per_request_and_greedy_tokens(tiny_llama, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp_path / "ref"
    rc = main(
        [
            "reference",
            str(tiny_llama),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "3",
            "--modules",
            "model.layers.0",
            "model.layers.1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32, use_kernels=False).eval()
    want = [model.generate(torch.tensor([p]), max_new_tokens=3, do_sample=False)[0, len(p) :].tolist() for p in PROMPTS]
    assert json.loads((out / "tokens.json").read_text()) == want
    steps = sorted(p.name for p in (out / "dp0").iterdir())
    assert steps == ["decode_b1_0", "decode_b1_1", "decode_b1_2", "decode_b1_3", "prefill_s3_1", "prefill_s5_0"]
    meta = json.loads((out / "dp0" / "prefill_s3_1" / "prefill_s3_1_meta.json").read_text())
    assert meta["req_ids"] == ["1"] and meta["positions"] == [0, 1, 2] and meta["token_request"] == [0, 0, 0]
    last = json.loads((out / "dp0" / "decode_b1_3" / "decode_b1_3_meta.json").read_text())
    assert last["req_ids"] == ["1"] and last["positions"] == [4]
    # the captured layer output is the eager one at every position
    hooked = {}
    h = model.model.layers[1].register_forward_hook(
        lambda m, a, o: hooked.__setitem__("out", o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        model(torch.tensor([PROMPTS[1] + want[1][:2]]))
    h.remove()
    got = load_file(out / "dp0" / "decode_b1_3" / "model.layers.1" / "rank0.safetensors")
    torch.testing.assert_close(got["output"][0, -1], hooked["out"][0, 4], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "text, words",
    [("{", "JSON"), ("[]", "non-empty"), ("[[1, -2]]", "token ids"), ('[["a"]]', "token ids"), ("[[]]", "non-empty")],
)
def test_bad_prompts_name_the_option(tmp_path, text, words):
    p = tmp_path / "p.json"
    p.write_text(text)
    with pytest.raises(ConfigError, match="--prompts") as info:
        read_prompts(p)
    assert words in str(info.value)


def test_a_token_past_the_vocabulary_is_refused(tiny_llama, tmp_path):
    p = tmp_path / "p.json"
    p.write_text("[[1, 999]]")
    rc = main(
        [
            "reference",
            str(tiny_llama),
            "--prompts",
            str(p),
            "--max-new-tokens",
            "1",
            "--modules",
            "model.layers.0",
            "--out",
            str(tmp_path / "ref"),
        ]
    )
    assert rc == 2
