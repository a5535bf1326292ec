"""A state-space model at real proportions through torch_xla's real XLA compiler (issue 38, item 1).

Mamba-2 (transformers' reference ``mamba2_chunk_scan``) with chunk size 8 and buckets 16 / 32 / 64 (multiples of
the chunk). A length that is a multiple of the chunk takes the branch of the scan that pads nothing; Dynamo traces
that graph guarded on the length being a multiple of 8, which the padding proof reads as a fact
(``padding_proof/guards.py``): calls at 24, 40, 48 and 56 (3 to 7 chunks) run at the buckets, XLA compiles nothing
per length, and the logits equal eager's on the CPU.

Not yet on this leg: lengths that are not multiples. On torch 2.9 Dynamo records layout guards in the padding
branch's graph (``should_swap``, a reshape's view check: the padded rows ``s + Mod(8 - Mod(s, 8), 8)`` differ from
``s``) that fail at every bucket that is a multiple of the chunk, so that graph is refused (and exact, run at each
length). torch 2.13 (the main leg) records none, and there both graphs bucket
(tests/static_shapes/test_chunked_real_proportions.py). The test checks that refusal too, so a torch_xla pairing
that lifts it shows up here.
"""

import copy
import os

import pytest

torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed: the XLA leg (make test-xla) runs these")
os.environ.setdefault("USE_TORCH_XLA", "0")  # transformers' own torch_xla paths stay off: the model is eager code
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import graphpass  # noqa: E402
from graphpass.backends import XlaDelegate  # noqa: E402

CHUNK = 8
BUCKETS = [16, 32, 64]
MULTIPLES = [24, 16, 40, 56, 48, 32, 64]  # 2 to 8 chunks; the first call (dynamic=True) is already symbolic
OTHERS = [9, 23]
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
    cfg = transformers.Mamba2Config(vocab_size=64, hidden_size=64, num_hidden_layers=2, state_size=16, expand=2,
                                    head_dim=16, num_heads=8, n_groups=1, conv_kernel=4, chunk_size=CHUNK)
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
    first = plans[0]  # traced at 24: the graph of the multiples
    assert first.active and not first.invalid_buckets, (first.refused, first.invalid_buckets)
    lengths = {s[1] for shapes in delegate.shapes for s in shapes if len(s) == 2 and s[0] == BATCH}
    assert not lengths & (set(MULTIPLES) - set(BUCKETS)), sorted(lengths)  # no multiple compiled at its own length
    assert lengths & set(BUCKETS)
    # the padding branch's graph on torch 2.9: refused for its layout guards at the multiples (see the docstring)
    rest = plans[1:]
    assert rest and all(not p.active and "fails at every bucket" in " ".join(p.refused) for p in rest), \
        [(p.active, p.refused) for p in rest]
