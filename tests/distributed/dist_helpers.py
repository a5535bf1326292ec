"""Multi-process helpers for tests/distributed/test_distributed.py: spawn gloo ranks on CPU with a hard timeout,
and the cases each rank runs (tensor parallel, FSDP2, DDP, TP x FSDP2) against single-process eager.

Every case builds the same model from the same seed on every rank, keeps an untouched copy as the
single-process eager reference, parallelizes the other copy, compiles it with
``graphpass.backend(then=...)`` and returns plain numbers (max differences, graph counts, explain
data) so the parent process can assert on them. A case that raises returns its traceback instead.
"""

from __future__ import annotations

import copy
import os
import socket
import tempfile
import time
import traceback
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

VOCAB = 128
BATCH = 4  # divisible by the data-parallel degree (2)
SEQ = 8


# ------------------------------------------------------------------ spawning


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, cases: list[tuple[str, str, dict]]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        GRAPHPASS_TEST_SCRATCH=out_dir,
    )
    torch.set_num_threads(1)  # 2-core CI machines: ranks must not oversubscribe
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for name, fn_name, kwargs in cases:
            torch._dynamo.reset()
            t0 = time.perf_counter()
            try:
                res = _case(fn_name)(rank, world, **kwargs)
            except Exception:  # reported to the parent, which fails the test naming it
                res = {"error": traceback.format_exc()}
            res["seconds"] = time.perf_counter() - t0
            results[name] = res
            dist.barrier()
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def scratch_folder() -> str:
    """A fresh folder (a disk offload's files) inside the run's output folder, which the parent removes."""
    return tempfile.mkdtemp(dir=os.environ.get("GRAPHPASS_TEST_SCRATCH"))


def _case(fn_name: str) -> Callable:
    """A case of :data:`CASES`, or ``"module:function"`` of another test module (imported in the rank)."""
    if ":" in fn_name:
        import importlib

        module, _, function = fn_name.partition(":")
        return getattr(importlib.import_module(module), function)
    return CASES[fn_name]


def ok(results: list[dict], name: str) -> list[dict]:
    """Case ``name``'s result on every rank; fails naming the rank whose case raised (its traceback)."""
    per_rank = [r[name] for r in results]
    for rank, res in enumerate(per_rank):
        assert "error" not in res, f"rank {rank}, {name}:\n{res['error']}"
    return per_rank


def run_ranks(world: int, cases: list[tuple[str, str, dict]], timeout: float = 180.0) -> list[dict]:
    """Run ``cases`` (name, case function name or ``"module:function"``, kwargs) on ``world`` gloo ranks;
    per-rank result dicts.

    Hard timeout: after ``timeout`` seconds every child is killed and TimeoutError is raised, so a
    hang (a collective one rank never joins) fails instead of blocking CI.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry, args=(world, free_port(), out_dir, cases), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world} ranks did not finish {[c[0] for c in cases]} in {timeout:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


# ------------------------------------------------------------------ models


def build(model: str) -> torch.nn.Module:
    """The tiny Llama (transformers) or graphpass's bundled transformer, same weights on every rank."""
    torch.manual_seed(0)
    if model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            use_cache=False,
        )
        return LlamaForCausalLM(cfg)
    from graphpass.models.transformer import TinyTransformer, TransformerConfig

    return TinyTransformer(TransformerConfig(vocab=VOCAB, hidden=64, heads=4, layers=2, mlp=128))


def blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.model.layers if hasattr(model, "model") else model.layers


def tp_plan(model_name: str) -> dict:
    """The standard colwise/rowwise plan, per block.

    Llama: q/k/v and gate/up colwise, o and down rowwise. The bundled transformer fuses q|k|v and
    gate|up into one Linear each, whose output is then split in ways a Shard(-1) DTensor cannot
    express (``view(b, s, 3, heads, hd)`` refuses uneven unflattening, in eager too), so its colwise
    layers all-gather their output (``output_layouts=Replicate()``) and the rowwise ones take that
    replicated input.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if model_name == "llama":
        return {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
    return {
        "attn.qkv": ColwiseParallel(output_layouts=Replicate()),
        "attn.o_proj": RowwiseParallel(input_layouts=Replicate()),
        "mlp.gate_up": ColwiseParallel(output_layouts=Replicate()),
        "mlp.down": RowwiseParallel(input_layouts=Replicate()),
    }


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, labels


def logits(out) -> torch.Tensor:
    return getattr(out, "logits", out)


def loss_of(out, labels) -> torch.Tensor:
    return F.cross_entropy(logits(out).reshape(-1, VOCAB), labels.reshape(-1))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _grad_diffs(ref: torch.nn.Module, model: torch.nn.Module) -> tuple[float, int]:
    """Largest |grad - reference grad| over every parameter (sharded grads gathered), and how many."""
    ref_grads = dict(ref.named_parameters())
    worst, count = 0.0, 0
    for name, p in model.named_parameters():
        r = ref_grads[name].grad
        assert p.grad is not None, f"no gradient for {name}"
        worst = max(worst, (_full(p.grad) - r).abs().max().item())
        count += 1
    return worst, count


def _reference(model_name: str, ids, labels, train: bool):
    ref = build(model_name)
    model = copy.deepcopy(ref)
    if train:
        loss_of(ref(ids), labels).backward()
    return ref, model


def _compile(model, then, **options):
    import graphpass

    gp = graphpass.backend(then=then, **options)
    return torch.compile(model, backend=gp), gp


def _graph_summary(gp) -> list[dict]:
    """Per graph: the frame it was traced from, its traps and its weights (FQN, placement, bytes)."""
    return [
        {
            "frame": g.analysis.roots.frame_name if g.analysis.roots else "",
            "traps": list(g.analysis.traps),
            "weights": [
                (t.fqn, t.kind, getattr(t, "placement", None), t.nbytes, t.traps) for t in g.analysis.weights()
            ],
        }
        for g in gp.graphs
    ]


def _trap_labels(gp) -> list[list[str]]:
    return [list(g.analysis.traps) for g in gp.graphs]


# ------------------------------------------------------------------ cases


def _train_step(ref, model, wrapped, ids, labels, mine: slice, then) -> dict:
    """Compile ``wrapped`` (the sharded ``model``, or its DDP wrapper), run this rank's batch shard
    ``mine`` forward and backward; the forward's and the gradients' differences from eager."""
    compiled, gp = _compile(wrapped, then)
    out = compiled(ids[mine])
    out_diff = (logits(out).detach() - logits(ref(ids[mine])).detach()).abs().max().item()
    loss_of(out, labels[mine]).backward()
    grad_diff, n = _grad_diffs(ref, model)
    return {
        "out_diff": out_diff,
        "grad_diff": grad_diff,
        "params": n,
        "graphs": len(gp.graphs),
        "traps": _trap_labels(gp),
        "boundaries": _count_boundaries(gp),
        "summary": _graph_summary(gp),
    }


def case_tp(rank, world, model_name, then="aot_eager"):
    """Tensor parallel on a 1-D mesh of every rank: forward logits vs eager."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    ids, _ = inputs()
    ref, model = _reference(model_name, ids, None, train=False)
    mesh = init_device_mesh("cpu", (world,))
    for block in blocks(model):
        parallelize_module(block, mesh, tp_plan(model_name))
    compiled, gp = _compile(model, then)
    with torch.no_grad():
        out = logits(compiled(ids))
        expected = logits(ref(ids))
    return {
        "out_diff": (out - expected).abs().max().item(),
        "graphs": len(gp.graphs),
        "traps": _trap_labels(gp),
        "boundaries": _count_boundaries(gp),
    }


def case_fsdp2(rank, world, model_name, then="aot_eager"):
    """FSDP2 fully_shard per block and at the root: forward on this rank's batch shard, then one
    training step's gradients (gathered) vs eager's on the whole batch."""
    from torch.distributed.fsdp import fully_shard

    ids, labels = inputs()
    ref, model = _reference(model_name, ids, labels, train=True)
    for block in blocks(model):
        fully_shard(block)
    fully_shard(model)
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return _train_step(ref, model, model, ids, labels, mine, then)


def case_ddp(rank, world, model_name, then="aot_eager"):
    """DDP with tiny buckets (DDPOptimizer splits the graph at every bucket): forward on this
    rank's batch shard, one training step's (all-reduced) gradients vs eager's on the whole batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids, labels = inputs()
    ref, model = _reference(model_name, ids, labels, train=True)
    # ~20 KB buckets: several even for these tiny models, so DDPOptimizer splits the graph. It
    # requires the first bucket's cap (a 1 MiB c10d constant it reads itself) to be no larger.
    dist._DEFAULT_FIRST_BUCKET_BYTES = 16 * 1024
    ddp = DDP(model, bucket_cap_mb=0.02)
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return _train_step(ref, model, ddp, ids, labels, mine, then)


def case_tp_fsdp2(rank, world, model_name, then="aot_eager"):
    """TP inside each block on the ``tp`` dim of a (dp=2, tp=world/2) mesh, FSDP2 over ``dp``:
    forward on this dp rank's batch shard and one training step's gradients vs eager."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    ids, labels = inputs()
    ref, model = _reference(model_name, ids, labels, train=True)
    dp = 2
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    for block in blocks(model):
        parallelize_module(block, mesh["tp"], tp_plan(model_name))
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    dp_rank = mesh["dp"].get_local_rank()
    mine = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    return _train_step(ref, model, model, ids, labels, mine, then)


def case_explain_tp(rank, world, model_name):
    """graphpass.explain of a TP model on this rank: traps and every weight's placement and bytes."""
    import graphpass
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    ids, _ = inputs()
    model = build(model_name)
    mesh = init_device_mesh("cpu", (world,))
    for block in blocks(model):
        parallelize_module(block, mesh, tp_plan(model_name))
    report = graphpass.explain(model, ids)
    data = report.to_dict()
    graph = report.graphs[0]
    collectives = {}
    for node in graph.gm.graph.nodes:
        if "_c10d_functional" in str(node.target) or "redistribute" in str(node.target):
            collectives[node.name] = graph.analysis.node_trap.get(node.name)
    return {
        "dict": data,
        "text": str(report),
        "tensor_table": report.tensor_table(),
        "collectives": collectives,
        "ops": [str(n.target) for n in graph.gm.graph.nodes if n.op != "placeholder"],
    }


def _count_boundaries(gp) -> int:
    from graphpass.ops import is_boundary

    return sum(1 for g in gp.graphs for n in g.gm.graph.nodes if is_boundary(n))


CASES: dict[str, Callable] = {
    "tp": case_tp,
    "fsdp2": case_fsdp2,
    "ddp": case_ddp,
    "tp_fsdp2": case_tp_fsdp2,
    "explain_tp": case_explain_tp,
}


# ------------------------------------------------------------------ offload per rank


def _tp_model(model_name: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model = build(model_name)
    mesh = init_device_mesh("cpu", (world,))
    for block in blocks(model):
        parallelize_module(block, mesh, tp_plan(model_name))
    return model


def _schedule_ops(gp) -> list[str]:
    """The graph's offload ops and collectives in graph order (what must be the same on every rank)."""
    keep = ("load_start", "load_wait", "evict", "_c10d_functional", "redistribute")
    return [
        str(n.target).split(".")[-2] if "graphpass" in str(n.target) else str(n.target)
        for g in gp.graphs
        for n in g.gm.graph.nodes
        if any(k in str(n.target) for k in keep)
    ]


def case_tp_offload(rank, world, model_name, storage, then="aot_eager", train=False):
    """graphpass.offload of a TP model: each rank streams its local shards. Against the same TP
    model compiled without offload (exact: offload only moves data) and single-process eager."""
    import graphpass

    ids, labels = inputs()
    ref = build(model_name)
    plain, model = _tp_model(model_name, world), _tp_model(model_name, world)
    if not train:
        for m in (ref, plain, model):
            m.eval().requires_grad_(False)
    local_bytes = sum(getattr(p, "_local_tensor", p).nbytes for p in blocks(model).parameters())
    global_bytes = sum(p.nbytes for p in blocks(ref).parameters())
    folder = scratch_folder() if storage == "disk" else None
    graphpass.offload(
        model,
        graphpass.OffloadConfig(
            device="cpu", storage=storage, disk_path=folder, include_patterns=[r"(model\.)?layers\.\d+"]
        ),
    )
    compiled, gp = _compile(model, then)
    compiled_plain, _ = _compile(plain, then)
    with torch.set_grad_enabled(train):
        out, out_plain, expected = (logits(f(ids)) for f in (compiled, compiled_plain, ref))
    res = {
        "out_diff": (out - expected).abs().max().item(),
        "plain_diff": (out - out_plain).abs().max().item(),
        "local_bytes": local_bytes,
        "global_bytes": global_bytes,
        "ops": _schedule_ops(gp),
        "stats": graphpass.memory_stats(compiled),
        "state_dict_diff": 0.0,
    }
    if train:
        loss_of(out, labels).backward()
        loss_of(expected, labels).backward()
        res["grad_diff"], res["params"] = _grad_diffs(ref, model)
    sd = model.state_dict()
    res["state_dict_diff"] = max((_full(sd[k]) - v).abs().max().item() for k, v in ref.state_dict().items())
    return res


def _fsdp2_model(model_name: str, **kwargs):
    from torch.distributed.fsdp import fully_shard

    model = build(model_name)
    for block in blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _fsdp2_offload_run(model_name, storage, train, then):
    """The eager reference, the plain FSDP2 model compiled and the offloaded one compiled (same weights)."""
    import graphpass

    ref, plain, model = build(model_name), _fsdp2_model(model_name), _fsdp2_model(model_name)
    if not train:
        for m in (ref, plain, model):
            m.eval().requires_grad_(False)
    local = [sum(p._local_tensor.nbytes for p in b.parameters()) for b in blocks(model)]
    folder = scratch_folder() if storage == "disk" else None
    graphpass.offload(
        model,
        graphpass.OffloadConfig(
            device="cpu", storage=storage, disk_path=folder, include_patterns=[r"(model\.)?layers\.\d+"]
        ),
    )
    compiled, gp = _compile(model, then)
    compiled_plain, _ = _compile(plain, then)
    return ref, model, compiled, compiled_plain, local, gp


def case_fsdp2_offload(rank, world, model_name, storage, train=False, then="aot_eager"):
    """graphpass.offload of an FSDP2 model (fully_shard per block and at the root): each rank
    streams its own shards into FSDP2's all-gathers. Forward on this rank's batch shard against the
    plain FSDP2 model compiled without offload (exact) and eager; a training step's gradients."""
    import graphpass

    ids, labels = inputs()
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    ref, model, compiled, compiled_plain, local, gp = _fsdp2_offload_run(model_name, storage, train, then)
    with torch.set_grad_enabled(train):
        out, out_plain, expected = (logits(f(ids[mine])) for f in (compiled, compiled_plain, ref))
    res = {
        "out_diff": (out - expected).abs().max().item(),
        "plain_diff": (out - out_plain).abs().max().item(),
        "block_bytes": local,
        "global_bytes": sum(p.nbytes for p in blocks(ref).parameters()),
        "stats": graphpass.memory_stats(compiled, reset=True),
        "graphs": len(gp.graphs),
    }
    if train:
        loss_of(out, labels[mine]).backward()
        loss_of(ref(ids), labels).backward()  # FSDP2 averages the ranks' gradients: eager on the whole batch
        res["grad_diff"], res["params"] = _grad_diffs(ref, model)
        res["backward_stats"] = graphpass.memory_stats(compiled)
        for m in (model, ref):  # the step updates the host copies in place: the next forward loads them
            torch.optim.SGD(m.parameters(), lr=0.5).step()
        res["step_diff"] = (logits(compiled(ids[mine])) - logits(ref(ids[mine]))).abs().max().item()
    sd = model.state_dict()
    res["state_dict_diff"] = max((_full(sd[k]) - v).abs().max().item() for k, v in ref.state_dict().items())
    return res


def case_fsdp2_own_offload(rank, world, model_name):
    """graphpass.offload of an FSDP2 model with its own CPUOffloadPolicy is refused naming both."""
    import graphpass
    from torch.distributed.fsdp import CPUOffloadPolicy

    model = _fsdp2_model(model_name, offload_policy=CPUOffloadPolicy(pin_memory=False))
    try:
        graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="cpu"))
    except graphpass.OffloadError as exc:
        return {"refused": str(exc)}
    return {"refused": ""}


def case_fsdp2_disk_backward(rank, world, model_name):
    """A backward through FSDP2 shards streamed from disk is refused (disk serves inference)."""
    import graphpass

    ids, labels = inputs()
    _, _, compiled, _, _, _ = _fsdp2_offload_run(model_name, "disk", True, "aot_eager")
    loss = loss_of(compiled(ids[:2]), labels[:2])
    try:
        loss.backward()
    except graphpass.OffloadError as exc:
        return {"refused": str(exc)}
    return {"refused": ""}


class SkipStack(torch.nn.Module):
    """Three linear blocks; ``skip`` names one the forward leaves out (a data-dependent early exit)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x, skip: int = -1):
        for i, layer in enumerate(self.layers):
            if i != skip:
                x = torch.tanh(layer(x))
        return x


def case_fsdp2_skipped_block(rank, world, storage="cpu"):
    """Issue 22 item 4: block 0's unshard starts block 1's load ahead; block 1 is skipped in that
    forward, its weights change (in place, on the host copies) before the next, which must
    compute with the new ones, not with the shard loaded ahead. Against eager on a plain copy."""
    import graphpass
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ref = SkipStack().eval().requires_grad_(False)
    model = copy.deepcopy(ref)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    graphpass.offload(
        model,
        graphpass.OffloadConfig(device="cpu", storage=storage, include_patterns=[r"layers\.\d+"], prefetch_distance=1),
    )
    compiled, _ = _compile(model, "aot_eager")
    x = torch.randn(4, 16)
    diffs = []
    with torch.no_grad():
        diffs.append((compiled(x, skip=1) - ref(x, skip=1)).abs().max().item())
        for m in (ref, model):  # an optimizer-like in-place update of block 1's weights (the host copies)
            for p in m.layers[1].parameters():
                p.add_(0.25)
        diffs.append((compiled(x) - ref(x)).abs().max().item())
        diffs.append((compiled(x) - ref(x)).abs().max().item())
    return {"diffs": diffs, "stats": graphpass.memory_stats(compiled)}


CASES.update(
    tp_offload=case_tp_offload,
    fsdp2_offload=case_fsdp2_offload,
    fsdp2_own_offload=case_fsdp2_own_offload,
    fsdp2_disk_backward=case_fsdp2_disk_backward,
    fsdp2_skipped_block=case_fsdp2_skipped_block,
)
