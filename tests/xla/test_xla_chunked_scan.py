"""A state-space model at real proportions through torch_xla's real XLA compiler (issue 38, item 1).

Mamba-2 (transformers' reference ``mamba2_chunk_scan``) with chunk size 8 and buckets 16 / 32 / 64 (multiples of
the chunk). A length that is a multiple of the chunk takes the branch of the scan that pads nothing; Dynamo traces
that graph guarded on the length being a multiple of 8, which the padding proof reads as a fact
(``padding_proof/guards.py``): calls at 24, 40, 48 and 56 (3 to 7 chunks) run at the buckets, XLA compiles nothing
per length, and the logits equal eager's on the CPU.

A length that is not a multiple takes the padding branch: a second graph, guarded on ``pad_size > 0`` (benign: at
a bucket it pads nothing, which is the other branch's result). On torch 2.9 Dynamo also records layout guards in
that graph (a reshape's contiguity check, ``Ne(128*P, 128*s)`` for the padded rows ``P = s + Mod(8 - Mod(s, 8), 8)``)
that fail at every multiple of the chunk; they are recorded inside an op, so the proof replays the graph at each
bucket's static sizes instead (``padding_proof/op_guards.py``): the sizes hold there, and that graph buckets too.
Every length of the sweep therefore compiles at a bucket only.
"""

import copy
import os

import pytest

torch_xla = pytest.importorskip(
    "torch_xla", reason="torch_xla is not installed: the XLA leg (make test-xla) runs these"
)
os.environ.setdefault("USE_TORCH_XLA", "0")  # transformers' own torch_xla paths stay off: the model is eager code
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import graphpass  # noqa: E402
from graphpass.backends import XlaDelegate  # noqa: E402

CHUNK = 8
BUCKETS = [16, 32, 64]
MULTIPLES = [24, 16, 40, 56, 48, 32, 64]  # 2 to 8 chunks; the first call (dynamic=True) is already symbolic
OTHERS = [9, 23, 17, 47, 63]  # not multiples: the padding branch, 2 to 8 chunks
BATCH = 5  # no other XLA test uses it: torch_xla's compilation cache is process-wide (see test_xla_static_shapes)


class ShapesXla(XlaDelegate):
    """then="openxla", recording the input shapes of every graph handed to torch_xla."""

    def __init__(self) -> None:
        super().__init__("openxla")
        self.shapes: list[tuple] = []

    def compile(self, gm, example_inputs):
        self.shapes.append(tuple(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)))
        return super().compile(gm, example_inputs)


def _mamba2():
    cfg = transformers.Mamba2Config(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=2,
        state_size=16,
        expand=2,
        head_dim=16,
        num_heads=8,
        n_groups=1,
        conv_kernel=4,
        chunk_size=CHUNK,
    )
    torch.manual_seed(0)
    return transformers.Mamba2ForCausalLM(cfg).float().eval()


def test_mamba2_compiles_at_the_buckets_only_over_several_chunks(xla_device):
    model = _mamba2()
    on_xla = copy.deepcopy(model).to(xla_device)
    delegate = ShapesXla()
    gp = graphpass.backend(then=delegate, traps=[], static_shapes={"dims": {"input_ids": 1}, "buckets": BUCKETS})
    compiled = torch.compile(on_xla, backend=gp, dynamic=True)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n in MULTIPLES + OTHERS:
            ids = torch.randint(0, 64, (BATCH, n), generator=g)
            out = compiled(input_ids=ids.to(xla_device), use_cache=False).logits
            ref = model(input_ids=ids, use_cache=False).logits
            assert out.shape == ref.shape
            # XLA blocks the matmuls and the chunk sums differently: fp32 rounding, rows never mix
            torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"length {n}: {m}")
    plans = [r.analysis.bucket_plan for r in gp.graphs if getattr(r.analysis, "bucket_plan", None) is not None]
    assert len(plans) == 2, [(p.active, p.refused) for p in plans]  # the multiples' graph, the padding branch's
    assert all(p.active and not p.invalid_buckets for p in plans), [(p.refused, p.invalid_buckets) for p in plans]
    lengths = {s[1] for shapes in delegate.shapes for s in shapes if len(s) == 2 and s[0] == BATCH}
    assert lengths <= set(BUCKETS), sorted(lengths)  # no length compiled at its own size, multiple or not


# the state-space and linear-attention kin, from the conformance harness's tiny configs with the chunk set to 8:
# the same proportions through the real XLA compiler (the stand-in's sweep: tests/static_shapes/
# test_chunked_real_proportions.py)
KIN_LENGTHS = [24, 9, 40, 17, 63, 32, 47]  # 2 to 8 chunks, multiples and not
KIN_BATCH = 3


def _kin(family, dense=False):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from helpers import bench_conformance

    cfg = bench_conformance().tiny_config(family)
    for key in ("chunk_size", "mamba_chunk_size"):
        if hasattr(cfg, key):
            setattr(cfg, key, CHUNK)
    if dense:  # a dense MLP in every layer: Jamba takes one below 2 experts, Qwen3-Next below 1
        cfg.num_experts = 1 if family == "jamba" else 0
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


@pytest.mark.parametrize("family, dense", [("bamba", False), ("mamba", False), ("qwen3_next", True), ("jamba", True)])
def test_state_space_kin_compile_at_the_buckets_only(xla_device, family, dense):
    """Batch 3. Mamba (v1) and Jamba on torch 2.9: graphpass's substitutes let transformers take its associative scan
    (``static_shapes/scan_trace.py``). Qwen3-Next and Jamba with dense MLPs: their MoE does not run on torch_xla
    (see the next test); the stand-in's sweep checks it (tests/static_shapes/test_chunked_real_proportions.py)."""
    model = _kin(family, dense)
    on_xla = copy.deepcopy(model).to(xla_device)
    delegate = ShapesXla()
    gp = graphpass.backend(then=delegate, traps=[], static_shapes={"dims": {"input_ids": 1}, "buckets": BUCKETS})
    compiled = torch.compile(on_xla, backend=gp, dynamic=True)
    g = torch.Generator().manual_seed(11)
    vocab = model.config.get_text_config().vocab_size
    with torch.no_grad():
        for n in KIN_LENGTHS:
            ids = torch.randint(0, vocab, (KIN_BATCH, n), generator=g)
            kw = {"attention_mask": torch.ones_like(ids), "use_cache": False}
            out = compiled(
                input_ids=ids.to(xla_device),
                **{k: (v.to(xla_device) if torch.is_tensor(v) else v) for k, v in kw.items()},
            ).logits
            ref = model(input_ids=ids, **kw).logits
            torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"length {n}: {m}")
    plans = [r.analysis.bucket_plan for r in gp.graphs if getattr(r.analysis, "bucket_plan", None) is not None]
    assert plans and all(p.active for p in plans), [(p.refused, p.invalid_buckets) for p in plans]
    lengths = {s[1] for shapes in delegate.shapes for s in shapes if len(s) == 2 and s[0] == KIN_BATCH}
    assert lengths <= set(BUCKETS), sorted(lengths)


@pytest.mark.parametrize("family", ["jamba", "qwen3_next"])
def test_their_moe_does_not_run_on_torch_xla_even_eagerly(xla_device, family):
    """Why the sweep above runs Jamba and Qwen3-Next with dense MLPs: their MoE (transformers'
    ``grouped_mm_experts_forward``) counts tokens per expert with ``torch.histc`` of an int tensor off the CPU, which
    torch_xla 2.9 runs on the CPU, where histc has no int kernel. Eager fails the same way, before any compiler. If
    this starts to pass, sweep them with their MoE."""
    model = _kin(family).to(xla_device)
    ids = torch.randint(0, 64, (KIN_BATCH, 9)).to(xla_device)
    with pytest.raises(NotImplementedError, match="histogram"), torch.no_grad():
        model(input_ids=ids, use_cache=False).logits.cpu()
