"""Offload: weights leave the device at offload(), loads/evictions per trap are in the compiled graph.

Every test runs on CPU (``device="cpu"``): a load is then a real copy into fresh memory (or a read
from a safetensors file), so the schedule, the counters and the residency are the real ones;
``storage="pinned"`` and the CUDA side stream run in ``bench/gpu_check.sh`` on a lent GPU.
"""

from __future__ import annotations

import copy
import gc
import os
import re

import pytest
import torch
import torch.nn as nn

import graphpass
from graphpass.models.corpus import CORPUS, build
from graphpass.offloading.ops import LOAD_START, LOAD_WAIT, EVICT
from graphpass.offloading.registry import lookup

from helpers import fresh_inputs

CPU = dict(device="cpu", storage="cpu")


def frozen(name, seed=0):
    model, inputs = build(name, seed)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, inputs


def run(compiled, *inputs):
    with torch.no_grad():
        return compiled(*inputs)


def trap_bytes(state, unit):
    return sum(r.nbytes for r in state.records if r.unit == unit)


# ------------------------------------------------------------------ config and errors, before anything runs


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(storage="ssd"), "storage"),
        (dict(device="cpu", storage="pinned"), "storage"),
        (dict(device="warp-drive"), "device"),
        (dict(device="meta", storage="cpu"), "device"),
        (dict(prefetch_distance=-1, **CPU), "prefetch_distance"),
        (dict(prefetch_distance=1.5, **CPU), "prefetch_distance"),
        (dict(max_device_bytes=0, **CPU), "max_device_bytes"),
        (dict(max_device_bytes="1GB", **CPU), "max_device_bytes"),
        (dict(include_patterns="layers.*", **CPU), "include_patterns"),
        (dict(include_patterns=[], **CPU), "include_patterns"),
        (dict(include_patterns=["layers.5-2"], **CPU), "include_patterns"),
        (dict(include_patterns=["layers.(["], **CPU), "include_patterns"),
        (dict(exclude_patterns=["("], **CPU), "exclude_patterns"),
        (dict(disk_path="/tmp/x", **CPU), "disk_path"),
        (dict(disk_path=3, device="cpu", storage="disk"), "disk_path"),
    ],
)
def test_bad_config_names_the_option(kwargs, key):
    with pytest.raises(graphpass.ConfigError) as info:
        graphpass.OffloadConfig(**kwargs)
    assert info.value.key == key


def test_errors_at_offload_leave_the_model_unchanged(tmp_path):
    model, inputs = frozen("mlp_stack")
    before = dict(model.named_parameters())
    with pytest.raises(graphpass.PatternMatchError, match="include_patterns"):
        graphpass.offload(model, graphpass.OffloadConfig(include_patterns=["blocks.*"], **CPU))
    with pytest.raises(graphpass.ConfigError, match="disk_path"):
        graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="disk"))
    with pytest.raises(graphpass.ConfigError, match="smaller than the largest trap plus its prefetch"):
        graphpass.offload(model, graphpass.OffloadConfig(max_device_bytes=1000, **CPU))
    if torch.cuda.is_available():  # pragma: no cover - CPU CI
        pytest.skip("needs a machine without CUDA")
    with pytest.raises(graphpass.ConfigError, match="CUDA is not available"):
        graphpass.offload(model, graphpass.OffloadConfig(device="cuda", storage="cpu"))
    after = dict(model.named_parameters())
    assert all(after[k] is before[k] for k in before)
    assert getattr(model, "_graphpass_offload", None) is None
    assert torch.equal(model(*inputs), model(*inputs))  # still an ordinary model


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad"])
def test_disk_with_weights_that_require_grad(mode, tmp_path):
    """Parameters that require grad (as from_pretrained leaves them) stream from disk in eval under
    no_grad / inference_mode; only a graph that needs a disk-streamed weight's gradient is refused,
    at compile time, naming the tensor."""
    model, inputs = build("mlp_stack")
    model.eval()
    assert all(p.requires_grad for p in model.parameters())
    ref = model(*inputs).detach()
    state = graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="disk", disk_path=tmp_path))
    assert all(p.requires_grad for p in model.parameters())
    assert list(state.parameters()) == []  # nothing streamed from a file is offered to an optimizer
    compiled = torch.compile(model, backend=graphpass.backend(then="aot_eager"))
    if mode == "grad":
        with pytest.raises(
            graphpass.OffloadError, match=r"needs the gradient of 'layers.0.fc1.weight'.*storage='disk'"
        ):
            compiled(*inputs)
        return
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        out = compiled(*inputs)
    assert torch.equal(out, ref)
    assert graphpass.memory_stats(model).groups_loaded > 0


def test_offloading_twice_and_stats_of_plain_model_raise():
    model, _ = frozen("mlp_stack")
    graphpass.offload(model, graphpass.OffloadConfig(**CPU))
    with pytest.raises(graphpass.OffloadError, match="already offloaded"):
        graphpass.offload(model, graphpass.OffloadConfig(**CPU))
    plain, _ = frozen("mlp_stack")
    with pytest.raises(graphpass.OffloadError, match="not offloaded"):
        graphpass.memory_stats(plain)


# ------------------------------------------------------------------ what offload() does to the model


def test_matched_tensors_leave_and_the_rest_stay():
    model, _ = frozen("quant_linear")
    old = {n: p for n, p in model.named_parameters()}
    state = graphpass.offload(model, graphpass.OffloadConfig(include_patterns=["layers.1"], **CPU))
    names = {r.name for r in state.records}
    assert names == {
        "layers.1.up.weight",
        "layers.1.up.weight.scale",
        "layers.1.up.bias",
        "layers.1.down.weight",
        "layers.1.down.weight.scale",
        "layers.1.down.bias",
    }
    for n, p in model.named_parameters():
        if n.startswith("layers.1."):
            assert lookup(p) is not None and p is not old[n]
        else:
            assert lookup(p) is None and p is old[n]
    # the inner field hangs off the new parameter and is offloaded with it
    w = model.layers[1].up.weight
    assert lookup(w.scale) is not None and w.scale.shape == old["layers.1.up.weight"].scale.shape


def test_eager_call_and_other_backends_raise_clearly():
    model, inputs = frozen("mlp_stack")
    graphpass.offload(model, graphpass.OffloadConfig(**CPU))
    with pytest.raises(graphpass.OffloadError, match="backend='graphpass'"):
        model(*inputs)
    with pytest.raises(graphpass.OffloadError, match="layers.0"):
        torch.compile(model, backend="aot_eager")(*inputs)


# ------------------------------------------------------------------ numerics: every tier, the corpus


@pytest.mark.parametrize("name", sorted(CORPUS))
@pytest.mark.parametrize("storage", ["cpu", "disk"])
def test_outputs_equal_eager(name, storage, tmp_path):
    model, inputs = frozen(name)
    ref_model, _ = frozen(name)  # same seed; deepcopy would drop inner fields such as weight.scale
    cfg = graphpass.OffloadConfig(device="cpu", storage=storage, disk_path=tmp_path if storage == "disk" else None)
    state = graphpass.offload(model, cfg)
    assert state.records
    compiled = torch.compile(model, backend=graphpass.backend(then="aot_eager"))
    for seed in (1, 2):
        x = fresh_inputs(inputs, seed=seed)
        assert torch.equal(run(compiled, *x), ref_model(*x))
    stats = graphpass.memory_stats(compiled)
    assert stats.bytes_loaded > 0 and stats.streamed_bytes_now == 0


def test_tied_weight_loaded_once_per_trap_that_reads_it():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
            self.lm_head = nn.Linear(16, 50, bias=False)
            self.lm_head.weight = self.embed.weight

        def forward(self, ids):
            x = self.embed(ids)
            for layer in self.layers:
                x = x + layer(x)
            return self.lm_head(x)

    torch.manual_seed(0)
    model = Tied().eval().requires_grad_(False)
    ref = copy.deepcopy(model)
    state = graphpass.offload(model, graphpass.OffloadConfig(include_patterns=["embed", "lm_head", "layers.*"], **CPU))
    (embed_unit,) = [u for u in state.plan.units if u.name == "embed"]
    assert embed_unit.saving_per_byte == 2.0  # one tensor, streamed for two traps
    gp = graphpass.backend(then="aot_eager", traps=["embed", "lm_head", "layers.0-1"])
    compiled = torch.compile(model, backend=gp)
    ids = torch.randint(0, 50, (2, 7))
    assert torch.equal(run(compiled, ids), ref(ids))
    sched = gp.graphs[0].analysis.offload
    by_label = {g.label: g.fqns for g in sched.groups}
    assert by_label["embed"] == ["embed.weight"] and by_label["lm_head"] == ["embed.weight"]
    starts = [n for n in gp.graphs[0].gm.graph.nodes if n.target is LOAD_START]
    assert len(starts) == 4  # embed, layers.0, layers.1, lm_head: each loaded once
    for n in starts:  # a tensor several ops read is in its trap's load once
        assert len(n.args[0]) == len(set(n.args[0]))


# ------------------------------------------------------------------ the schedule


def offloaded(name="mlp_stack", prefetch=1, then="aot_eager", **kw):
    """(reference copy taken before offloading, inputs, state, backend, compiled)."""
    model, inputs = frozen(name)
    ref, _ = frozen(name)
    state = graphpass.offload(model, graphpass.OffloadConfig(prefetch_distance=prefetch, **CPU, **kw))
    gp = graphpass.backend(then=then)
    return ref, inputs, state, gp, torch.compile(model, backend=gp)


@pytest.mark.parametrize("distance", [0, 1, 2, 3])
def test_fsdp2_blocks_prefetch_the_adjacent_block_only(distance):
    """FSDP2's streamed blocks ask the one window rule (PrefetchWindow.next_block): at distance >= 1
    a block's unshard starts its neighbour's load (the next in the forward, the previous in the
    backward), never one further; at distance 0 none."""
    from graphpass.offloading.schedule import PrefetchWindow

    window = PrefetchWindow(distance)
    forward = [window.next_block(k, 4) for k in range(4)]
    backward = [window.next_block(k, 4, backward=True) for k in range(4)]
    if distance == 0:
        assert forward == backward == [None] * 4
    else:
        assert forward == [1, 2, 3, None] and backward == [None, 0, 1, 2]
    assert window.next_block(0, 1) is None and window.next_block(0, 1, backward=True) is None


def test_one_graph_per_frame_not_per_unit():
    ref, inputs, state, gp, compiled = offloaded("tiny_transformer")
    run(compiled, *inputs)
    assert len(gp.graphs) == 1
    assert len(gp.graphs[0].analysis.offload.groups) == 2


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_prefetch_order_and_measured_peak(prefetch):
    ref, inputs, state, gp, compiled = offloaded("mlp_stack", prefetch=prefetch)
    with graphpass.trace_traps() as events:
        run(compiled, *inputs)
    one = trap_bytes(state, "layers.0")
    stats = graphpass.memory_stats(compiled)
    assert stats.peak_streamed_bytes == min(prefetch + 1, 3) * one
    assert gp.graphs[0].analysis.offload.peak_streamed_bytes == stats.peak_streamed_bytes
    # the load of trap k + prefetch is issued before trap k computes, and after trap k-1's eviction
    seq = [e for e in events if e[0] in ("load", "enter", "evict")]
    for k in range(3):
        enter = seq.index(("enter", f"layers.{k}"))
        ahead = min(k + prefetch, 2)
        assert seq.index(("load", f"layers.{ahead}")) < enter
        if k + prefetch <= 2 and k >= 1:
            assert seq.index(("load", f"layers.{k + prefetch}")) > seq.index(("evict", f"layers.{k - 1}"))
    assert stats.groups_loaded == 3 and stats.evictions == 3 and stats.loads_issued == 12


def test_inductor_keeps_the_schedule():
    """inductor reorders nodes; the data dependencies keep loads one trap ahead and no further."""
    ref, inputs, state, gp, compiled = offloaded("mlp_stack", prefetch=1, then="inductor")
    x = fresh_inputs(inputs)
    with graphpass.trace_traps() as events:
        out = run(compiled, *x)
    torch.testing.assert_close(out, ref(*x), rtol=1e-5, atol=1e-5)  # inductor reorders the matmul sums
    stats = graphpass.memory_stats(compiled)
    assert stats.peak_streamed_bytes == 2 * trap_bytes(state, "layers.0")
    loads = [e for e in events if e[0] in ("load", "wait", "evict")]
    assert loads[:3] == [("load", "layers.0"), ("load", "layers.1"), ("wait", "layers.0")]
    assert loads.index(("evict", "layers.0")) < loads.index(("load", "layers.2")) < loads.index(("wait", "layers.1"))


def test_budget_keeps_best_units_resident_and_is_respected():
    model, inputs = frozen("mlp_stack")
    ref = copy.deepcopy(model)
    one = sum(p.numel() * 4 for p in model.layers[0].parameters())
    budget = 3 * one  # window of two traps (prefetch 1) + one resident unit
    state = graphpass.offload(model, graphpass.OffloadConfig(max_device_bytes=budget, **CPU))
    decisions = {u.name: u.resident for u in state.plan.units}
    assert decisions == {"layers.0": True, "layers.1": False, "layers.2": False}
    assert lookup(model.layers[0].fc1.weight) is None  # resident: an ordinary device tensor
    report = str(graphpass.explain(model, *inputs))
    assert "resident" in report and "streamed" in report and f"budget {budget:,}" in report
    compiled = torch.compile(model, backend=graphpass.backend(then="aot_eager"))
    assert torch.equal(run(compiled, *inputs), ref(*inputs))
    stats = graphpass.memory_stats(compiled)
    assert stats.resident_bytes == one and stats.peak_resident_bytes <= budget


def test_budget_below_a_graph_trap_window_fails_at_compile():
    """A budget that fits the units but not a coarser trap of the graph is refused before running."""

    class Paired(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

        def forward(self, x):
            with graphpass.trap_block("pair"):  # one manual trap over two units
                x = self.layers[1](self.layers[0](x))
            return self.layers[2](x)

    model = Paired().eval().requires_grad_(False)
    one = sum(p.numel() * 4 for p in model.layers[0].parameters())
    graphpass.offload(model, graphpass.OffloadConfig(max_device_bytes=2 * one, **CPU))
    compiled = torch.compile(model, backend=graphpass.backend(then="aot_eager"))
    with pytest.raises(graphpass.OffloadError, match="max_device_bytes"):
        run(compiled, torch.randn(2, 16))


# ------------------------------------------------------------------ training


@pytest.mark.parametrize("then", ["aot_eager", "inductor"])
def test_training_reloads_in_backward(then):
    torch.manual_seed(0)
    model, inputs = build("mlp_stack")
    ref = copy.deepcopy(model)
    state = graphpass.offload(model, graphpass.OffloadConfig(**CPU))
    compiled = torch.compile(model, backend=graphpass.backend(then=then))
    x = fresh_inputs(inputs)
    out = compiled(*x)
    after_fwd = graphpass.memory_stats(compiled, reset=True)
    assert after_fwd.streamed_bytes_now == 0  # no device copy kept for the backward
    out.square().sum().backward()
    bwd = graphpass.memory_stats(compiled)
    assert bwd.groups_loaded >= 2  # the backward loads again what it reads
    assert bwd.peak_streamed_bytes <= 2 * trap_bytes(state, "layers.0")
    ref(*x).square().sum().backward()
    grads = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n].grad, p.grad, rtol=1e-5, atol=1e-6)
        assert grads[n].grad.device == grads[n].device  # gradients land on the host copy


# ------------------------------------------------------------------ disk: files, meta models, checkpoints


def save_checkpoint(model, path):
    from safetensors.torch import save_model

    save_model(model, str(path))  # as transformers does: a tied tensor is stored once


def meta_copy(name):
    model, inputs = frozen(name)
    with torch.device("meta"):
        empty, _ = build(name)
    empty.eval().requires_grad_(False)
    return model, empty, inputs


def test_meta_model_from_checkpoint_never_materializes(tmp_path):
    model, empty, inputs = meta_copy("tiny_transformer")
    save_checkpoint(model, tmp_path / "model.safetensors")
    state = graphpass.offload(empty, graphpass.OffloadConfig(device="cpu", storage="disk"), checkpoint=tmp_path)
    assert all(r.location is not None and r.location.path.endswith("model.safetensors") for r in state.records)
    assert not list(tmp_path.glob("graphpass-offload-*"))  # read from the checkpoint, no copy written
    assert not any(t.device.type == "meta" for t in empty.state_dict().values())
    compiled = torch.compile(empty, backend=graphpass.backend(then="aot_eager"))
    x = fresh_inputs(inputs)
    assert torch.equal(run(compiled, *x), model(*x))


def test_sharded_checkpoint_with_index(tmp_path):
    import json
    from safetensors.torch import save_file

    model, empty, inputs = meta_copy("mlp_stack")
    sd = model.state_dict()
    names = sorted(sd)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for f, keys in shards.items():
        save_file({k: sd[k].contiguous() for k in keys}, str(tmp_path / f))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, keys in shards.items() for k in keys}})
    )
    graphpass.offload(empty, graphpass.OffloadConfig(device="cpu", storage="disk"), checkpoint=tmp_path)
    compiled = torch.compile(empty, backend=graphpass.backend(then="aot_eager"))
    assert torch.equal(run(compiled, *inputs), model(*inputs))


@pytest.mark.parametrize("storage", ["cpu", "disk"])
@pytest.mark.parametrize("which", ["one", "none"])
def test_a_real_model_whose_names_the_checkpoint_lacks_is_refused_naming_them(tmp_path, storage, which):
    """Issue 22 item 6: a real (not meta) model kept its own weights, silently, for every name the
    checkpoint lacked, even when no name matched (a difference of 0.5 in the issue's run); with
    storage="disk" a missing key was reported as a missing disk_path."""
    from safetensors.torch import save_file

    model, inputs = frozen("mlp_stack")
    other, _ = frozen("mlp_stack", seed=1)  # the checkpoint's values: the model's own would be wrong
    sd = {k: v.contiguous() for k, v in other.state_dict().items()}
    if which == "one":
        del sd["layers.1.fc2.weight"]
    else:
        sd = {f"model.{k}": v for k, v in sd.items()}  # a prefix: no name matches
    path = tmp_path / "ckpt.safetensors"
    save_file(sd, str(path))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    want = r"layers\.1\.fc2\.weight" if which == "one" else r"'proj_in\.weight'.* and \d+ more"
    with pytest.raises(
        graphpass.OffloadError, match=rf"checkpoint '{re.escape(str(path))}' holds no tensor named .*{want}"
    ):
        graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage=storage), checkpoint=path)
    assert getattr(model, "_graphpass_offload", None) is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing changed


def test_a_real_model_keeps_a_real_buffer_the_checkpoint_lacks(tmp_path):
    """What the refusal keeps allowed (docs/offload.md): a buffer computed at construction."""
    from safetensors.torch import save_file

    model, inputs = frozen("mlp_stack")
    model.register_buffer("scale", torch.ones(1), persistent=False)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "ckpt.safetensors"))
    graphpass.offload(
        model, graphpass.OffloadConfig(device="cpu", storage="cpu"), checkpoint=tmp_path / "ckpt.safetensors"
    )
    assert torch.equal(model.scale, torch.ones(1))


def test_checkpoint_problems_name_the_tensor_and_change_nothing(tmp_path):
    model, empty, _ = meta_copy("mlp_stack")
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    from safetensors.torch import save_file

    cfg = graphpass.OffloadConfig(device="cpu", storage="disk")
    missing = dict(sd)
    del missing["layers.1.fc2.weight"]
    save_file(missing, str(tmp_path / "missing.safetensors"))
    with pytest.raises(graphpass.OffloadError, match="layers.1.fc2.weight"):
        graphpass.offload(empty, cfg, checkpoint=tmp_path / "missing.safetensors")

    wrong = dict(sd)
    wrong["layers.0.fc1.weight"] = torch.zeros(3, 3)
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(graphpass.OffloadError, match="layers.0.fc1.weight"):
        graphpass.offload(empty, cfg, checkpoint=tmp_path / "wrong.safetensors")

    save_file(sd, str(tmp_path / "full.safetensors"))
    raw = (tmp_path / "full.safetensors").read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(raw[: len(raw) - 100])
    with pytest.raises(graphpass.OffloadError, match="truncated"):
        graphpass.offload(empty, cfg, checkpoint=tmp_path / "truncated.safetensors")

    (tmp_path / "foreign.safetensors").write_bytes(b"PK\x03\x04 this is a zip, not safetensors" * 10)
    with pytest.raises(graphpass.OffloadError, match="not a safetensors file"):
        graphpass.offload(empty, cfg, checkpoint=tmp_path / "foreign.safetensors")

    with pytest.raises(graphpass.OffloadError, match="does not exist"):
        graphpass.offload(empty, cfg, checkpoint=tmp_path / "nope.safetensors")
    with pytest.raises(graphpass.OffloadError, match="meta device"):
        graphpass.offload(empty, cfg)
    # nothing was loaded half-way: the model is still all meta and not offloaded
    assert all(t.device.type == "meta" for t in empty.state_dict().values())
    assert getattr(empty, "_graphpass_offload", None) is None


def _truncate_leased(path, size):
    """Truncate a file this process holds a read lease on (the stand-ins the offloaded model holds):
    the kernel's lease-break signal to this process interrupts the call once (EINTR), after which
    graphpass has copied its regions and released the lease (docs/reliability.md)."""
    for _ in range(50):
        try:
            return os.truncate(path, size)
        except InterruptedError:
            continue
    raise AssertionError("truncate interrupted 50 times")


def test_file_truncated_after_offload_fails_naming_the_tensor(tmp_path):
    model, inputs = frozen("mlp_stack")
    state = graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="disk", disk_path=tmp_path))
    (path,) = state.files
    _truncate_leased(path, os.path.getsize(path) // 2)
    compiled = torch.compile(model, backend=graphpass.backend(then="aot_eager"))
    with pytest.raises(graphpass.OffloadError, match=r"layers\.\d\.fc\d\.(weight|bias)'.*truncated"):
        run(compiled, *inputs)


def test_written_files_are_safetensors_and_removed_with_the_model(tmp_path):
    from safetensors import safe_open

    model, inputs = frozen("mlp_stack")
    ref = copy.deepcopy(model)
    state = graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="disk", disk_path=tmp_path))
    (path,) = state.files
    with safe_open(path, framework="pt") as f:
        assert torch.equal(f.get_tensor("layers.2.fc1.weight"), ref.layers[2].fc1.weight)
    assert not list(tmp_path.glob(".graphpass-*"))  # no temporary left behind
    del model, state
    gc.collect()
    assert not os.path.exists(path)


def test_disk_stand_ins_hold_no_data(tmp_path):
    """The model's streamed tensors are untouched stand-ins: never read, never written by graphpass."""
    model, inputs = frozen("mlp_stack")
    state = graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="disk", disk_path=str(tmp_path)))
    for rec in state.records:
        assert rec.location is not None and rec.host.shape == rec.shape


# ------------------------------------------------------------------ isolation, delegates


def test_two_instances_of_one_class_each_load_their_own_weights():
    a, inputs = frozen("mlp_stack", seed=0)
    b, _ = frozen("mlp_stack", seed=1)
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    graphpass.offload(a, graphpass.OffloadConfig(**CPU))
    graphpass.offload(b, graphpass.OffloadConfig(**CPU))
    ca = torch.compile(a, backend=graphpass.backend(then="aot_eager"))
    cb = torch.compile(b, backend=graphpass.backend(then="aot_eager"))
    x = fresh_inputs(inputs)
    assert torch.equal(run(ca, *x), ref_a(*x))
    assert torch.equal(run(cb, *x), ref_b(*x))
    assert graphpass.memory_stats(ca).groups_loaded == 3 and graphpass.memory_stats(cb).groups_loaded == 3


def test_strict_delegate_gets_only_aten_pieces(strict_backend):
    from graphpass.backends import NeuronDelegate

    model, inputs = frozen("tiny_transformer")
    ref = copy.deepcopy(model)
    graphpass.offload(model, graphpass.OffloadConfig(**CPU))
    delegate = NeuronDelegate(registered_name="strict_aten_standin", module=None)
    compiled = torch.compile(model, backend=graphpass.backend(then=delegate))
    x = fresh_inputs(inputs)
    assert torch.equal(run(compiled, *x), ref(*x))
    for gm in strict_backend.graphs:
        assert not any("graphpass" in str(n.target) for n in gm.graph.nodes)
    assert graphpass.memory_stats(compiled).groups_loaded == 2


def test_graph_break_inside_the_layer_stack():
    ref, inputs, state, gp, compiled = offloaded("graph_break")
    x = fresh_inputs(inputs)
    with graphpass.trace_traps() as events:
        assert torch.equal(run(compiled, *x), ref(*x))
    assert len(gp.graphs) >= 2
    loaded = [g.label for rec in gp.graphs if rec.analysis.offload for g in rec.analysis.offload.groups]
    assert {"layers.0", "layers.1"} <= set(loaded)
    # Dynamo runs the frame it compiled for one layer for the next (the offload guard puts no module
    # name in the graph): the load, wait and eviction labels move with the tensors, like trap labels
    for kind in ("load", "wait", "evict", "enter"):
        assert {label for k, label in events if k == kind} == {"layers.0", "layers.1", "layers.2"}, (kind, events)
    assert graphpass.memory_stats(compiled).peak_streamed_bytes <= 2 * trap_bytes(state, "layers.0")


def test_opcheck():
    """``evict`` passes every opcheck test. ``load_start``/``load_wait`` identify the model from the
    very tensor they receive (its storage), and opcheck hands ops clones, so for them only the
    autograd registration is checked here; their schema, fake kernels and AOTAutograd behaviour are
    exercised end to end above (aot_eager, inductor, training, strict delegates)."""
    model, _ = frozen("mlp_stack")
    state = graphpass.offload(model, graphpass.OffloadConfig(**CPU))
    srcs = [r.host for r in state.records[:4]]
    dev = torch.device("cpu")
    torch.library.opcheck(EVICT, ([s.clone() for s in srcs], srcs, "layers.0", []))
    ticket = LOAD_START(srcs, "layers.0", dev, [])
    torch.library.opcheck(LOAD_START, (srcs, "layers.0", dev, []), test_utils=("test_autograd_registration",))
    torch.library.opcheck(LOAD_WAIT, (ticket, srcs, "layers.0", dev, []), test_utils=("test_autograd_registration",))
    with pytest.raises(graphpass.OffloadError, match="not a tensor graphpass.offload"):
        LOAD_START([s.clone() for s in srcs], "layers.0", dev, [])


def test_host_load_buffers_are_reused_not_reallocated():
    """On a host device a load reuses a buffer once nothing references it: steady state allocates
    nothing, and the pool settles at the schedule's peak."""
    ref, inputs, state, gp, compiled = offloaded("mlp_stack", prefetch=1)
    x = fresh_inputs(inputs)
    for _ in range(3):
        assert torch.equal(run(compiled, *x), ref(*x))
    stats = graphpass.memory_stats(compiled)
    assert stats.buffer_pool_bytes == stats.peak_streamed_bytes == 2 * trap_bytes(state, "layers.0")
    for _ in range(3):
        run(compiled, *x)
    assert graphpass.memory_stats(compiled).buffer_pool_bytes == stats.buffer_pool_bytes


def test_graph_writing_an_offloaded_tensor_is_refused():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            for layer in self.layers:
                layer.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            for layer in self.layers:
                layer.calls.add_(1)  # a buffer updated in place: the update would be lost
                x = layer(x)
            return x

    model = Counter().eval().requires_grad_(False)
    graphpass.offload(model, graphpass.OffloadConfig(**CPU))
    compiled = torch.compile(model, backend=graphpass.backend(then="aot_eager"))
    with pytest.raises(graphpass.OffloadError, match=r"writes offloaded tensor 'layers.0.calls' in place"):
        run(compiled, torch.randn(2, 8))

    class ThroughAView(Counter):
        def forward(self, x):
            for layer in self.layers:
                layer.calls.view(-1).add_(1)  # the write goes through a view
                x = layer(x)
            return x

    torch._dynamo.reset()
    model = ThroughAView().eval().requires_grad_(False)
    graphpass.offload(model, graphpass.OffloadConfig(**CPU))
    compiled = torch.compile(model, backend=graphpass.backend(then="aot_eager"))
    with pytest.raises(graphpass.OffloadError, match=r"writes offloaded tensor 'layers.0.calls' in place"):
        run(compiled, torch.randn(2, 8))


@pytest.mark.parametrize("spare_core", [False, True])
def test_disk_mappings_with_and_without_populating(spare_core, monkeypatch, tmp_path):
    """disk -> host device maps the file region; with a core to spare the worker also fills the
    page tables (MAP_POPULATE). Both give the eager result, and nothing stays mapped after a call."""
    import graphpass.offloading.staging as staging

    monkeypatch.setattr(staging, "_spare_core", lambda: spare_core)
    model, inputs = frozen("tiny_transformer")
    ref, _ = frozen("tiny_transformer")
    graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="disk", disk_path=tmp_path))
    compiled = torch.compile(model, backend=graphpass.backend(then="aot_eager"))
    for seed in (3, 4):
        x = fresh_inputs(inputs, seed=seed)
        assert torch.equal(run(compiled, *x), ref(*x))
    assert graphpass.memory_stats(compiled).streamed_bytes_now == 0


def test_training_backward_stays_within_the_budget():
    torch.manual_seed(0)
    model, inputs = build("mlp_stack")
    ref, _ = build("mlp_stack")
    one = sum(p.numel() * 4 for p in model.layers[0].parameters())
    budget = 3 * one  # one unit resident + the streaming window of two
    state = graphpass.offload(model, graphpass.OffloadConfig(max_device_bytes=budget, **CPU))
    assert [u.resident for u in state.plan.units] == [True, False, False]
    compiled = torch.compile(model, backend=graphpass.backend(then="inductor"))
    x = fresh_inputs(inputs)
    out = compiled(*x)
    assert graphpass.memory_stats(compiled, reset=True).peak_resident_bytes <= budget
    out.square().sum().backward()
    bwd = graphpass.memory_stats(compiled)
    assert bwd.groups_loaded >= 1 and bwd.peak_resident_bytes <= budget
    ref(*x).square().sum().backward()
    grads = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n].grad, p.grad, rtol=1e-5, atol=1e-6)


def test_two_threads_share_one_offloaded_model():
    """Each call's tickets are its own: two threads running the same compiled model concurrently
    get their own loads and the eager result."""
    import threading

    ref, inputs, state, gp, compiled = offloaded("mlp_stack", prefetch=1)
    xs = [fresh_inputs(inputs, seed=s) for s in range(2)]
    run(compiled, *xs[0])  # compile once, in this thread
    errors = []

    def worker(x):
        try:
            for _ in range(20):
                if not torch.equal(run(compiled, *x), ref(*x)):
                    errors.append("mismatch")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(x,)) for x in xs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert graphpass.memory_stats(compiled).streamed_bytes_now == 0


def test_offload_with_static_shape_buckets():
    """Each bucket's graph carries the loads; the oversize dynamic fallback too."""
    import warnings

    model, _ = frozen("tiny_transformer")
    ref, _ = frozen("tiny_transformer")
    graphpass.offload(model, graphpass.OffloadConfig(**CPU))
    gp = graphpass.backend(then="aot_eager", static_shapes={"dims": {"ids": 1}, "buckets": [8, 16]})
    compiled = torch.compile(model, backend=gp, dynamic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in (3, 9, 12, 20):
            ids = torch.randint(0, 64, (1, n))
            # padding changes matmul shapes, so BLAS may block the sums differently
            torch.testing.assert_close(run(compiled, ids), ref(ids), rtol=1e-5, atol=1e-6)
    assert graphpass.memory_stats(compiled).groups_loaded == 8  # two traps per call


def test_a_call_that_raises_mid_forward_leaves_nothing_behind():
    """Loads started before an error are dropped with their tickets; the next call neither hangs
    nor finds them (this deadlocked before the runtime's lock was re-entrant)."""
    import threading

    class Failing(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

        def forward(self, x, idx):
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i == 0:
                    x = x + x.index_select(0, idx)  # an out-of-range idx raises here, mid-forward
            return x

    torch.manual_seed(0)
    model = Failing().eval().requires_grad_(False)
    ref = copy.deepcopy(model)
    graphpass.offload(model, graphpass.OffloadConfig(**CPU))
    compiled = torch.compile(model, backend=graphpass.backend(then="aot_eager"))
    x, good, bad = torch.randn(4, 8), torch.tensor([1, 0, 3, 2]), torch.tensor([1, 0, 99, 2])
    assert torch.equal(run(compiled, x, good), ref(x, good))
    with pytest.raises((IndexError, RuntimeError)):
        run(compiled, x, bad)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("out", run(compiled, x, good)))
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "the call after an error hung"
    assert torch.equal(result["out"], ref(x, good))
    gc.collect()
    assert graphpass.memory_stats(compiled).streamed_bytes_now == 0


def test_tied_tensor_held_by_an_excluded_module_stays_and_empty_tensors_are_not_streamed():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.layers[1].weight = self.layers[0].weight
            self.layers[0].register_buffer("empty", torch.zeros(0))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = Tied().eval().requires_grad_(False)
    state = graphpass.offload(model, graphpass.OffloadConfig(exclude_patterns=["layers.1"], **CPU))
    names = {r.name for r in state.records}
    assert names == {"layers.0.bias"}  # the tied weight is held by layers.1 too: it stays
    assert lookup(torch.zeros(0)) is None


@pytest.mark.parametrize("then", ["aot_eager", "inductor"])
def test_training_with_device_stand_ins(then):
    """The accelerator path on a host device: the model holds one-element expanded stand-ins, the
    loads read the host copies, and the gradients accumulate on those host copies."""
    from graphpass.offloading import install

    torch.manual_seed(0)
    model, inputs = build("mlp_stack")
    ref, _ = build("mlp_stack")
    with install.device_stand_ins_on_host():
        state = graphpass.offload(model, graphpass.OffloadConfig(**CPU))
    assert all(p.stride() == (0,) * p.dim() for n, p in model.named_parameters() if n.startswith("layers."))
    compiled = torch.compile(model, backend=graphpass.backend(then=then))
    x = fresh_inputs(inputs)
    for _ in range(2):  # gradients accumulate like autograd's
        compiled(*x).square().sum().backward()
        ref(*x).square().sum().backward()
    host = {r.name: r.host for r in state.records}
    params = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        got = host[n].grad if n in host else params[n].grad
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-5)
        if n in host:
            assert params[n].grad is None  # nothing full-size lands on the stand-in
    trainable = list(state.parameters(model))
    assert len(trainable) == len(ref_params := list(ref.parameters()))
    opt = torch.optim.SGD(trainable, lr=0.1)
    opt.step()  # updates the host copies the next load reads
    ref_opt = torch.optim.SGD(ref_params, lr=0.1)
    ref_opt.step()
    with torch.no_grad():
        torch.testing.assert_close(compiled(*x), ref(*x), rtol=1e-5, atol=1e-5)


def test_cuda_graph_slots_go_round_and_pass_over_a_referenced_slot():
    """The fixed slots of recorded loads (exercised on host memory): views shaped as the records at
    64-byte aligned offsets; round robin; a slot a tensor still references is never handed out."""
    from graphpass.offloading.graph_slots import GraphSlots

    model, _ = frozen("mlp_stack")
    state = graphpass.offload(model, graphpass.OffloadConfig(**CPU))
    groups = {}
    for r in state.records:
        groups.setdefault(r.unit, []).append(r)
    recs = groups["layers.0"]
    offsets, total = GraphSlots.layout(recs)
    assert all(o % 64 == 0 for o in offsets) and total >= sum(r.nbytes for r in recs)
    slots = GraphSlots(torch.device("cpu"), total, 2)
    a = slots.take(recs)
    assert [tuple(t.shape) for t in a] == [r.shape for r in recs] and [t.dtype for t in a] == [r.dtype for r in recs]
    b = slots.take(recs)
    assert a[0].untyped_storage().data_ptr() != b[0].untyped_storage().data_ptr()
    assert slots.take(recs) is None  # both slots referenced (a and b alive)
    kept = a[1]
    del a
    assert slots.take(recs) is None  # one view of the first slot is still alive
    del kept
    c = slots.take(recs)
    assert c[0].untyped_storage().data_ptr() == slots.storages[0].data_ptr()
    for t, r in zip(c, recs):
        t.copy_(r.host)
        assert torch.equal(t, r.host)
    assert slots.take(recs + recs) is None  # larger than a slot


def test_cuda_graph_delegates_are_recognised():
    from graphpass.config import GraphpassConfig
    from graphpass.passes.insert_offload_schedule import records_cuda_graphs

    assert records_cuda_graphs(GraphpassConfig.from_options(then="cudagraphs"))
    assert records_cuda_graphs(GraphpassConfig.from_options(then="inductor", mode="reduce-overhead"))
    assert records_cuda_graphs(
        GraphpassConfig.from_options(then="inductor", delegate_options={"triton.cudagraphs": True})
    )
    assert not records_cuda_graphs(GraphpassConfig.from_options(then="inductor"))
    assert not records_cuda_graphs(GraphpassConfig.from_options(then="aot_eager"))


@pytest.mark.parametrize("case", ["then=cudagraphs", "static-shape buckets", "pageable storage", "pinned"])
def test_cuda_graph_offload_refusals_name_the_option(case):
    """What a recorded load cannot replay is refused at compile time, naming the option; pinned
    storage through inductor's reduce-overhead reserves the slots (``prefetch_distance + 1``)."""
    from types import SimpleNamespace

    from graphpass.config import GraphpassConfig
    from graphpass.passes.insert_offload_schedule import _prepare_cuda_graphs

    model, _ = frozen("mlp_stack")
    state = graphpass.offload(model, graphpass.OffloadConfig(**CPU))
    groups = [[r for r in state.records if r.unit == u] for u in ("layers.0", "layers.1")]
    opts = {
        "then=cudagraphs": dict(then="cudagraphs"),
        "static-shape buckets": dict(
            then="inductor", mode="reduce-overhead", static_shapes={"dims": {"x": 0}, "buckets": [8]}
        ),
    }
    config = GraphpassConfig.from_options(**opts.get(case, dict(then="inductor", mode="reduce-overhead")))
    reserved = []
    facts = SimpleNamespace(
        storage="cpu" if case == "pageable storage" else "pinned", reserve_graph_slots=reserved.append
    )
    if case == "pinned":  # records as pinned storage makes them (page-locked host copies; no CUDA here)
        groups = [
            [SimpleNamespace(name=r.name, location=None, host=SimpleNamespace(is_pinned=lambda: True)) for r in g]
            for g in groups
        ]
    expected = {
        "then=cudagraphs": r"then='cudagraphs'.*mode='reduce-overhead'",
        "static-shape buckets": "drop static_shapes",
        "pageable storage": r"storage='cpu'.*'layers\.0\..*storage='pinned'",
    }
    if case in expected:
        with pytest.raises(graphpass.OffloadError, match=expected[case]):
            _prepare_cuda_graphs(facts, groups, config)
        assert not reserved
    else:
        _prepare_cuda_graphs(facts, groups, config)
        assert reserved == [groups]


def test_cuda_graph_slots_are_reserved_once_and_grown_as_a_new_set():
    """A larger need adds a set (graphs recorded with the old one keep their addresses); a smaller one adds nothing."""
    model, _ = frozen("mlp_stack")
    state = graphpass.offload(model, graphpass.OffloadConfig(**CPU))
    facts = state.facts
    one = [[r for r in state.records if r.unit == "layers.0"]]
    facts.reserve_graph_slots(one)
    facts.reserve_graph_slots(one)
    assert len(facts.graph_slots) == 1 and len(facts.graph_slots[0].storages) == state.config.prefetch_distance + 1
    facts.reserve_graph_slots([one[0] + [r for r in state.records if r.unit == "layers.1"]])
    assert len(facts.graph_slots) == 2 and facts.graph_slots[1].nbytes > facts.graph_slots[0].nbytes
    facts.reserve_graph_slots(one)
    assert len(facts.graph_slots) == 2


def test_gradient_landing_keeps_the_first_buffer_and_adds_later_ones():
    """The worker's half of the device->host gradient copies (exercised with host tensors and a
    finished copy): the first gradient is the buffer itself, a later one is added and its buffer
    returns to the pool; finish_gradients waits for every addition."""
    from types import SimpleNamespace

    model, _ = frozen("mlp_stack")
    state = graphpass.offload(model, graphpass.OffloadConfig(**CPU))
    runtime = state.runtime
    host = torch.nn.Parameter(torch.zeros(4, 8))
    done = SimpleNamespace(synchronize=lambda: None)
    first, second = torch.empty(4 * 32, dtype=torch.uint8), torch.empty(4 * 32, dtype=torch.uint8)
    first.view(torch.float32).fill_(1.0)
    second.view(torch.float32).fill_(2.0)
    pending = [
        runtime._worker().submit(runtime._grads.land, host, buf, buf.view(torch.float32).view(4, 8), done)
        for buf in (first, second)
    ]
    runtime._grads.pending.extend(pending)
    runtime.finish_gradients()
    assert not runtime._grads.pending
    assert host.grad.data_ptr() == first.data_ptr()  # no copy of the first gradient
    assert torch.equal(host.grad, torch.full((4, 8), 3.0))
    assert runtime._staging.take(32 * 4) is second  # the added one's buffer is reused


# ------------------------------------------------------------------ refused at compile time: += on an offloaded
# buffer, tensors replaced after offload() (from tests/core/test_architecture.py)


class _Steps(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        for layer in self.layers:
            layer.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        for layer in self.layers:
            layer.steps += 1  # Dynamo records operator.iadd
            x = layer(x)
        return x


def test_augmented_assignment_on_an_offloaded_buffer_is_refused_at_compile_time():
    """Before the toolkit, the offload pass did not know ``operator.iadd``: the first call replaced
    the buffer with its loaded copy, the second failed with a misleading error."""
    model = _Steps().eval().requires_grad_(False)
    graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="cpu"))
    compiled = torch.compile(model, backend=graphpass.backend(then="eager"))
    with pytest.raises(graphpass.OffloadError, match=r"writes offloaded tensor 'layers.0.steps' in place"):
        with torch.no_grad():
            compiled(torch.randn(2, 8))


def test_tensors_replaced_after_offload_are_refused_at_compile_time():
    """``.half()`` after ``offload()`` replaced every offloaded tensor: the graph holds the guards
    but reads no offloaded tensor, which used to run silently on the replaced (garbage) tensors."""
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(2))).eval().requires_grad_(False)
    graphpass.offload(model, graphpass.OffloadConfig(include_patterns=["0", "1"], device="cpu", storage="cpu"))
    model.double()
    compiled = torch.compile(model, backend=graphpass.backend(then="eager"))
    with pytest.raises(graphpass.OffloadError, match=r"replaced after offload\(\)"):
        with torch.no_grad():
            compiled(torch.randn(2, 8, dtype=torch.float64))
