"""static_shapes' checked mode (``"verify": True``): the first call of each bucket runs again with another padding
fill and the real rows are compared bitwise; a mismatch refuses the bucket."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpass
from graphpass.errors import ConfigError
from graphpass.static_shapes.dispatcher import first_difference, other_fill, within_rounding

from helpers import CountingBackend

BUCKETS = [8, 16, 32]
H = 16


def compiled_with(model, counter, dims, verify, **extra):
    gp = graphpass.backend(then=counter, static_shapes={"dims": dims, "buckets": BUCKETS, "verify": verify, **extra})
    return torch.compile(model, backend=gp, dynamic=True), gp


def runner_of(gp):
    (runner,) = [g.runner for g in gp.graphs if g.runner is not None]
    return runner


def static_warnings(caught):
    return [str(w.message) for w in caught if "static_shapes" in str(w.message)]


class CausalBlock(nn.Module):
    """Causal self-attention with a float input: every padded input is varied by the checked mode."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H)
        self.out = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, H // 2).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(h.transpose(1, 2).reshape(b, n, H))


class CentredBySum(nn.Module):
    """Subtracts the mean over the padded dim: the padding changes every real row (the proof refuses it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(1, keepdim=True)


class PaddingMaskedSdpa(nn.Module):
    """Bidirectional attention whose mask is the (zero-padded) attention mask read in place (as in
    tests/static_shapes/test_padding_safety.py): the proof relies on the mask's zero padding."""

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        pm = attention_mask.to(torch.bool)
        kv = torch.arange(n)[None, None, None, :]
        mask = torch.ones((), dtype=torch.bool) & pm[torch.arange(b)[:, None, None, None], kv]
        h = x.view(b, n, 2, H // 2).transpose(1, 2)
        out = F.scaled_dot_product_attention(h, h, h, attn_mask=mask.expand(b, 1, n, n))
        return out.transpose(1, 2).reshape(b, n, H)


# --------------------------------------------------------------------------------------------
# a sound proof: every bucket verified, once, silently
# --------------------------------------------------------------------------------------------


def test_a_sound_model_verifies_each_bucket_once_without_a_warning():
    torch.manual_seed(0)
    model = CausalBlock().eval()
    counter = CountingBackend()
    f, gp = compiled_with(model, counter, {"x": 1}, True)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for n in (3, 5, 9, 20, 12, 7, 31):
            x = torch.randn(2, n, H)
            torch.testing.assert_close(f(x), model(x), rtol=1e-5, atol=1e-6)
    assert static_warnings(caught) == []
    runner = runner_of(gp)
    assert sorted(b for ((_, b),), *_ in runner.verified) == BUCKETS
    assert set(runner.verified.values()) == {"verified"}
    assert counter.calls == len(BUCKETS) and len(runner.compiled) == len(BUCKETS) and not runner.oversize
    assert sum(m.endswith(" verified; padding of 1 input(s) varied") for m in runner.log) == len(BUCKETS)


def test_the_second_run_reads_its_own_buffers_and_leaves_the_staging_buffers_alone():
    """The checked run's inputs are new buffers holding the same real rows and another fill; the persistent staging
    buffer keeps the usual fill (zeros) and its address."""
    seen = []

    def delegate(gm, example_inputs):
        def run(*args):
            seen.append([a.clone() if isinstance(a, torch.Tensor) and a.dim() == 3 else None for a in args])
            return gm.forward(*args)

        return run

    model = CausalBlock().eval()
    f, gp = compiled_with(model, delegate, {"x": 1}, True)
    x = torch.randn(2, 5, H)
    with torch.no_grad():
        f(x)
        f(x)
    runner = runner_of(gp)
    (buf,) = runner.staging.values()
    assert torch.equal(buf[:, :5], x) and not buf[:, 5:].any()
    assert len(seen) == 3  # the first call twice (usual fill, other fill), the second call once
    (usual,), (other,), _ = ([a for a in s if a is not None] for s in seen)
    assert torch.equal(usual[:, :5], x) and torch.equal(other[:, :5], x)
    assert not usual[:, 5:].any() and (other[:, 5:] == 1).all()


def test_ids_only_model_costs_nothing_more():
    """Token ids are zero-padded integers the proof may read as zeros: nothing to vary, no second run."""
    from graphpass.models.transformer import TinyTransformer, TransformerConfig

    model = TinyTransformer(TransformerConfig(vocab=64, hidden=32, heads=2, layers=1, mlp=64, max_seq=32)).eval()
    calls = []

    def delegate(gm, example_inputs):
        return lambda *a: calls.append(1) or gm.forward(*a)

    f, gp = compiled_with(model, delegate, {"ids": 1}, True)
    with torch.no_grad():
        for n in (5, 6, 11):
            ids = torch.randint(0, 64, (1, n))
            torch.testing.assert_close(f(ids), model(ids), rtol=1e-5, atol=1e-6)
    assert len(calls) == 3
    assert all(v.startswith("unchecked: every padded input") for v in runner_of(gp).verified.values())


# --------------------------------------------------------------------------------------------
# an unsound acceptance: the checked mode catches it
# --------------------------------------------------------------------------------------------


@pytest.fixture
def proof_accepts_everything(monkeypatch):
    """The padding proof as the planner calls it, made to accept every graph (an unsound rule)."""
    from graphpass.static_shapes import padding_proof

    monkeypatch.setattr(padding_proof, "prove_padding", lambda *a, **k: padding_proof.PaddingProof())


def test_without_verify_an_unsound_acceptance_gives_wrong_results(proof_accepts_everything):
    model = CentredBySum()
    f, gp = compiled_with(model, CountingBackend(), {"x": 1}, False)
    x = torch.randn(2, 5, H)
    with torch.no_grad():
        got = f(x)
    assert runner_of(gp).plan.active
    assert not torch.allclose(got, model(x), atol=1e-3)  # the padding rows moved the mean: the test can fail


def test_verify_refuses_the_bucket_of_an_unsound_acceptance(proof_accepts_everything):
    model = CentredBySum()
    counter = CountingBackend()
    f, gp = compiled_with(model, counter, {"x": 1}, True)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        x = torch.randn(2, 5, H)
        assert torch.equal(f(x), model(x))  # this very call: the unpadded result, exact
        msgs = static_warnings(caught)
        assert len(msgs) == 1
        assert "verify: bucket 8 refused" in msgs[0] and "output 0" in msgs[0] and "largest difference" in msgs[0]
        runner = runner_of(gp)
        assert not runner.compiled and not runner.staging  # the bucket's graph and buffers are dropped
        for n in (6, 8, 3):  # later calls in bucket 8 run unpadded
            x = torch.randn(2, n, H)
            assert torch.equal(f(x), model(x))
        assert not runner.compiled and runner.oversize
        assert len(static_warnings(caught)) == 1  # said once
        x = torch.randn(2, 12, H)  # bucket 16: checked and refused on its own, and said although bucket 8 was
        assert torch.equal(f(x), model(x))
    msgs = static_warnings(caught)
    assert len(msgs) == 2 and "bucket 16 refused" in msgs[1]
    assert [v.split(":")[0] for v in runner.verified.values()] == ["refused", "refused"]


def test_verify_restores_inputs_the_graph_writes_before_the_second_run(proof_accepts_everything):
    """A graph that writes into an input (a counter, a cache) must see the same input on both runs, and the input
    must end as one call left it, also when the bucket is refused (the unpadded rerun)."""

    class Counts(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("steps", torch.zeros(()))

        def forward(self, x):
            self.steps.add_(1)
            return x - x.mean(1, keepdim=True) + self.steps

    model = Counts()
    ref = Counts()
    f, gp = compiled_with(model, CountingBackend(), {"x": 1}, True)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for n in (5, 6, 12):
            x = torch.randn(2, n, H)
            assert torch.equal(f(x), ref(x))
            assert model.steps.item() == ref.steps.item()
    assert len(static_warnings(caught)) == 2  # buckets 8 and 16 refused, not 'not checked'
    assert runner_of(gp)._written  # found in the graph, restored around the runs


def test_a_sound_graph_that_writes_an_input_is_verified_and_writes_it_once():
    """Verified only if the second run saw the input as the first did (else the counter differs: a mismatch)."""

    class CountedBlock(CausalBlock):
        def __init__(self):
            super().__init__()
            self.register_buffer("steps", torch.zeros(()))

        def forward(self, x):
            self.steps.add_(1)
            return super().forward(x) * self.steps

    torch.manual_seed(0)
    model = CountedBlock().eval()
    f, gp = compiled_with(model, CountingBackend(), {"x": 1}, True)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for k, n in enumerate((5, 6, 12), start=1):
            x = torch.randn(2, n, H)
            out = f(x)
            assert model.steps.item() == k
            torch.testing.assert_close(out, CausalBlock.forward(model, x) * k, rtol=1e-5, atol=1e-6)
    assert static_warnings(caught) == []
    assert set(runner_of(gp).verified.values()) == {"verified"}


def noisy_delegate(scale):
    """Adds noise of ``scale`` to every output on every run: two runs are never bitwise equal."""

    def noisy(gm, example_inputs):
        return lambda *a: [o + torch.rand_like(o) * scale for o in gm.forward(*a)]

    return noisy


def test_a_difference_within_rounding_is_verified_not_refused():
    """Padding rows may change how real rows are computed without changing what (a mixture of experts routes padding
    tokens too: its experts' GEMMs get other sizes and round otherwise): within the dtype's rounding is verified."""
    torch.manual_seed(0)
    model = CausalBlock().eval()
    f, gp = compiled_with(model, noisy_delegate(1e-7), {"x": 1}, True)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        x = torch.randn(2, 5, H)
        torch.testing.assert_close(f(x), model(x), rtol=1e-5, atol=1e-5)
    assert static_warnings(caught) == []
    (state,) = runner_of(gp).verified.values()
    assert state.startswith("verified within rounding (output 0, largest difference")


def test_a_graph_that_is_not_bitwise_deterministic_is_kept_unchecked_with_a_warning():
    """Two runs with the same padding differ beyond rounding (a stand-in for a nondeterministic kernel): the
    comparison says nothing about the padding, so the bucket stays padded (not refused), and the warning says why."""
    noisy = noisy_delegate(1e-3)

    torch.manual_seed(0)
    model = CausalBlock().eval()
    f, gp = compiled_with(model, noisy, {"x": 1}, True)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for n in (5, 6):
            x = torch.randn(2, n, H)
            torch.testing.assert_close(f(x), model(x), rtol=0, atol=2e-3)
    (msg,) = static_warnings(caught)
    assert "bucket 8 not checked: two runs with the same padding differ bitwise" in msg
    runner = runner_of(gp)
    assert list(runner.verified.values()) == ["unchecked: not bitwise deterministic"] and runner.compiled


# --------------------------------------------------------------------------------------------
# a proof that relies on a zero-padded attention mask: no false alarm
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mask_dtype", [torch.long, torch.bool, torch.float32])
def test_a_proof_reading_the_masks_zero_padding_is_no_false_alarm(mask_dtype):
    model = PaddingMaskedSdpa()
    f, gp = compiled_with(model, CountingBackend(), {"x": 1, "attention_mask": 1}, True)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for n in (5, 7, 12):
            x, mask = torch.randn(2, n, H), torch.ones(2, n, dtype=mask_dtype)
            torch.testing.assert_close(f(x, mask), model(x, mask), rtol=1e-5, atol=1e-6)
    assert static_warnings(caught) == []
    runner = runner_of(gp)
    assert runner.plan.active and list(runner.plan.zero_inputs.values()) == ["l_attention_mask_"]
    assert set(runner.verified.values()) == {"verified"} and len(runner.verified) == 2


@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_transformers_models_fed_embeddings_verify_without_a_false_alarm(model_type):
    """inputs_embeds varied, the attention mask's zero padding kept: llama verifies bitwise; mixtral's experts get
    other GEMM sizes from the padding tokens' routing, so it verifies within rounding, not bitwise, and is not
    refused."""
    pytest.importorskip("transformers")
    from helpers import bench_conformance

    model = bench_conformance().build_model(model_type).eval()
    emb = model.get_input_embeddings()
    f, gp = compiled_with(model, "eager", {"inputs_embeds": 1}, True)
    g = torch.Generator().manual_seed(7)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for n in (5, 9, 17, 23):
            ids = torch.randint(0, model.config.vocab_size, (1, n), generator=g)
            kw = {"inputs_embeds": emb(ids), "attention_mask": torch.ones_like(ids)}
            torch.testing.assert_close(f(**kw).logits, model(**kw).logits, rtol=1e-5, atol=1e-5)
    assert static_warnings(caught) == []
    runner = runner_of(gp)
    assert list(runner.plan.zero_inputs.values()) == ["l_kwargs_attention_mask_"]
    assert len(runner.verified) == 3 and all(v.startswith("verified") for v in runner.verified.values())
    if model_type == "llama":
        assert set(runner.verified.values()) == {"verified"}  # bitwise


# --------------------------------------------------------------------------------------------
# config, fills, the comparison
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["yes", 1, 0, None, [True]])
def test_verify_must_be_a_bool(bad):
    with pytest.raises(ConfigError) as info:
        graphpass.backend(static_shapes={"dims": {"ids": 1}, "buckets": [8], "verify": bad})
    assert info.value.key == "static_shapes.verify" and "'static_shapes.verify'" in str(info.value)


def test_verify_is_a_known_key_and_off_by_default():
    from graphpass.static_shapes.config import check_static_shapes

    assert check_static_shapes({"dims": {"ids": 1}, "buckets": [8]}).verify is False
    assert check_static_shapes({"dims": {"ids": 1}, "buckets": [8], "verify": True}).verify is True
    with pytest.raises(ConfigError, match="known: buckets, dims, masked, pad_value, verify"):
        check_static_shapes({"dims": {"ids": 1}, "buckets": [8], "verfy": True})


def test_other_fill_is_finite_differs_and_stays_an_index():
    assert other_fill(0.0, torch.float32) == 1.0 and other_fill(-0.5, torch.bfloat16) == 0.5
    assert other_fill(float("-inf"), torch.float32) == 0.0
    assert other_fill(1e30, torch.float32) == 0.0  # 1e30 +- 1 rounds back to 1e30
    assert other_fill(65504.0, torch.float16) == 0.0  # 65504 +- 1 rounds back to 65504 in float16
    assert other_fill(0, torch.long) == 1 and other_fill(63, torch.long) == 62 and other_fill(-1, torch.long) == 0
    assert other_fill(1, torch.bool) is False and other_fill(0, torch.bool) is True


def test_first_difference_is_bitwise_and_nan_aware():
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert first_difference((a,), (a.clone(),)) is None
    assert first_difference((a,), (torch.tensor([1.0, float("nan"), 3.0 + 2**-22]),))[0] == 0
    k, what = first_difference((a, a), (a, torch.tensor([1.0, 2.0, 3.5])))
    assert k == 1 and "NaN in 1 positions" in what and "0.5" in what
    assert first_difference((torch.tensor([1, 2]),), (torch.tensor([1, 5]),)) == (0, "largest difference 3")


def test_within_rounding_is_the_dtypes_tolerance_and_exact_for_integers():
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert within_rounding((a,), (a + 1e-7,)) and not within_rounding((a,), (a + 1e-3,))
    assert within_rounding((a.bfloat16(),), ((a + 1e-2).bfloat16(),))
    assert not within_rounding((a,), (torch.tensor([1.0, 2.0, 3.0]),))  # NaN against a number
    assert not within_rounding((torch.tensor([1, 2]),), (torch.tensor([1, 3]),))
