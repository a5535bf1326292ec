"""Static-shape buckets on real transformers language models, through a static-only compiler.

The stand-in (``StrictAtenBackend`` behind ``NeuronDelegate``) refuses any symbolic size, as AWS
Neuron does. Over a sweep of 12 prompt lengths it must see at most ``len(buckets) + 1`` compiles of
the model (one per bucket, plus Dynamo's first exact-size trace), and the logits on the real
positions must equal eager's. Called as users call the model: with an ``attention_mask`` (which
Dynamo gives a length symbol of its own) and with ``use_cache=False`` (transformers' packed-sequence
mask path, indexing ``position_ids`` with position tensors).
"""

import pytest
import torch

from graphpass.backends import NeuronDelegate

from helpers import bench_conformance, sweep_buckets

pytest.importorskip("transformers")

conformance = bench_conformance()

BUCKETS = [16, 32, 64]
LENGTHS = [2, 5, 9, 16, 17, 23, 31, 33, 40, 47, 58, 63]  # 12 lengths over all three buckets
# dense families with both ways of calling, and a mixture of experts (transformers' grouped-GEMM experts,
# checked as a row-wise function), eager attention with transformers' additive mask (gemma2: softcapped scores,
# sliding-window layers; bloom: ALiBi scores through baddbmm and bmm; mpt: masked_fill with the mask
# converted to bool; megatron-bert: the bidirectional mask of a BERT-style model used as a language model; gpt_oss:
# attention sinks appended after the keys and dropped after the softmax; mamba: the selective scan traced as one
# op and unrolled at each bucket's size for the static-only compiler); bench/conformance.py's static column covers
# every causal-LM architecture
CASES = [
    ("llama", "attention_mask"),
    ("gpt2", "no_cache"),
    ("qwen3", "attention_mask"),
    ("olmo2", "no_cache"),
    ("mixtral", "attention_mask"),
    ("gemma2", "attention_mask"),
    ("bloom", "attention_mask"),
    ("mpt", "attention_mask"),
    ("megatron-bert", "attention_mask"),
    ("gpt_oss", "attention_mask"),
    ("mamba", "no_cache"),
]
CALLS = {
    "attention_mask": lambda ids: {"attention_mask": torch.ones_like(ids)},
    "no_cache": lambda ids: {"use_cache": False},
}


def _sweep(model, strict, call):
    delegate = NeuronDelegate(registered_name="strict_aten_standin", module=None)
    gp, _, pieces = sweep_buckets(
        model,
        delegate,
        LENGTHS,
        BUCKETS,
        strict=strict,
        call=lambda m, ids: m(input_ids=ids, **CALLS[call](ids)).logits,
    )
    return gp, pieces


@pytest.mark.parametrize("family,call", CASES)
def test_real_lm_pads_to_buckets_through_a_static_only_compiler(strict_backend, family, call):
    model = conformance.build_model(family)
    gp, pieces = _sweep(model, strict_backend, call)
    plans = [g.analysis.bucket_plan for g in gp.graphs if getattr(g.analysis, "bucket_plan", None) is not None]
    assert plans and all(p.active for p in plans), [p.refused for p in plans]
    compiles, rest = divmod(len(strict_backend.graphs), pieces)
    assert rest == 0 and compiles <= len(BUCKETS) + 1, (len(strict_backend.graphs), pieces)
    seq_lens = {s[1] for shapes in strict_backend.shapes for s in shapes if len(s) == 2 and s[0] == 1}
    seq_lens.discard(conformance.MAX_POS)  # a [1, max_positions] position-ids buffer (BERT-style), not a length
    assert seq_lens <= set(BUCKETS) | {LENGTHS[0]}, seq_lens  # the compiler never saw another length


def grouped_mm_experts_forward(x):
    """Named like transformers' row-wise experts function, but in another file: checked op by op."""
    order = torch.sort(x.sum(-1), dim=1).indices
    return torch.gather(x, 1, order.unsqueeze(-1).expand_as(x))


def test_row_wise_functions_are_trusted_by_file_and_name_only():
    from graphpass.static_shapes.padding_safety import check_padding_safety

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    f = torch.compile(grouped_mm_experts_forward, backend=keep, dynamic=True)
    f(torch.randn(2, 7, 4))
    x = next(
        n.meta["example_value"]
        for n in graphs[0].graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor)
    )
    sym = x.shape[1].node.expr  # the length dim
    got = check_padding_safety(graphs[0], {sym})
    assert got and "sort along the padded dim mixes rows" in got[0].reason
