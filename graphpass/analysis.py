"""The analysis object every pass shares: which tensor input belongs to which module and trap.

Built by :mod:`graphpass.passes.analyze_ownership` and :mod:`graphpass.passes.assign_traps` from
the graph alone: placeholder sources give each input's fully qualified name, ``nn_module_stack``
gives the module every op ran in. No hooks, no tracing modes, no warm-up runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .fx_utils import op_name
from .roots import ParsedSource, Roots, parse_source_name  # noqa: F401 (ParsedSource, parse_source_name re-exported)

if TYPE_CHECKING:
    from .offloading.schedule import OffloadSchedule
    from .static_shapes.plan import BucketPlan

# --------------------------------------------------------------------------------------------
# Names: nn_module_stack paths -> module FQNs (Dynamo source names are parsed in roots.py)
# --------------------------------------------------------------------------------------------


def module_paths(node: torch.fx.Node, roots: Roots | None = None) -> list[str]:
    """The modules ``node`` ran in, outermost first, as FQNs in the model (``layers.0.mlp``).

    ``roots`` (a :class:`graphpass.roots.Roots`) places paths of a graph traced from a submodule's
    own frame, or from a wrapper's ``args[0]``, in the whole model.
    """
    stack = node.meta.get("nn_module_stack") or {}
    out: list[str] = []
    for value in stack.values():
        raw = str(value[0] if isinstance(value, tuple) else value)
        parsed = parse_source_name(raw)
        if parsed is None:
            fqn = raw
        elif roots is not None:
            fqn = roots.qualify(parsed)
        else:
            fqn = parsed.fqn
        if fqn and (not out or out[-1] != fqn):
            out.append(fqn)
    return out


# --------------------------------------------------------------------------------------------
# The analysis records
# --------------------------------------------------------------------------------------------


@dataclass
class TensorOwnership:
    """One tensor input of a graph and everything known about who owns it."""

    node: str  # placeholder name in the graph
    index: int  # position among the graph's inputs
    source: str  # Dynamo source name, as Dynamo prints it
    kind: str  # parameter | buffer | inner | attribute | input
    fqns: list[str]  # every FQN this tensor is reachable by (several when tied)
    parent: str | None  # inner tensor fields: FQN of the parameter/buffer they belong to
    holders: list[str]  # modules that hold it as an attribute (from its FQNs)
    consumers: list[str]  # modules whose ops read it (from nn_module_stack), in graph order
    traps: list[str] = field(default_factory=list)  # traps whose ops read it, in graph order
    shape: tuple = ()  # of the graph input on this rank (a DTensor's local shard)
    dtype: str = ""
    nbytes: int = 0  # bytes of the graph input on this rank (a DTensor's local shard)
    # Under torch.distributed (None / equal to the above otherwise):
    placement: str | None = None  # "Shard(0)", "Replicate()", "dp=Shard(0), tp=Shard(0)" on a named 2-D mesh
    mesh: str | None = None  # the device mesh (or DDP process group) as "cpu[0, 1]", "cpu[[0, 1], [2, 3]] (dp, tp)"
    sharded_by: str | None = None  # "dtensor", "fsdp2" (sharded at rest, gathered before the graph), "ddp"
    global_shape: tuple = ()  # the whole tensor's shape across the mesh
    global_nbytes: int = 0  # the whole tensor's bytes across the mesh
    local_nbytes: int = 0  # bytes this rank holds at rest (an FSDP2 shard; else nbytes)
    # a tensor subclass wrapping plain tensors (torchao's Int8Tensor): their names below it
    # ("qdata", "scale"); nbytes is theirs, summed. Empty for a plain tensor.
    inner: list[str] = field(default_factory=list)

    @property
    def inner_fqns(self) -> list[str]:
        """``layers.0.up.weight.qdata``, ...: the wrapped tensors by FQN (empty for a plain tensor)."""
        return [f"{self.fqn}.{name}" for name in self.inner]

    @property
    def fqn(self) -> str:
        return self.fqns[0] if self.fqns else self.source

    @property
    def owners(self) -> list[str]:
        """Holders and consumers, deduplicated, holders first."""
        return list(dict.fromkeys(self.holders + self.consumers))

    @property
    def is_weight(self) -> bool:
        return self.kind in ("parameter", "buffer", "inner", "attribute")


@dataclass
class Trap:
    """One trap region of a graph."""

    label: str
    manual: bool
    modules: list[str] = field(default_factory=list)  # module FQNs whose ops are in the region
    nodes: list[str] = field(default_factory=list)  # op nodes in the region, in graph order
    tensors: list[str] = field(default_factory=list)  # placeholder names of weights it reads
    nbytes: int = 0
    collectives: list[str] = field(default_factory=list)  # collective / redistribution nodes in the region

    @property
    def first_node(self) -> str | None:
        return self.nodes[0] if self.nodes else None

    @property
    def last_node(self) -> str | None:
        return self.nodes[-1] if self.nodes else None


@dataclass
class GraphAnalysis:
    """Ownership and traps of one Dynamo graph. Shared by every pass of the pipeline."""

    roots: Roots | None = None  # the model objects the sources start from
    node_modules: dict[str, list[str]] = field(default_factory=dict)  # op node -> module FQNs, outermost first
    tensors: dict[str, TensorOwnership] = field(default_factory=dict)
    traps: dict[str, Trap] = field(default_factory=dict)
    node_trap: dict[str, str] = field(default_factory=dict)  # op node name -> trap label
    consumer_nodes: dict[str, list[str]] = field(default_factory=dict)  # placeholder -> op nodes reading it
    trap_container: str | None = None  # auto traps: the module list they were found in
    module_names: list[str] = field(default_factory=list)  # every module FQN known for the model
    collectives: dict[str, str | None] = field(default_factory=dict)  # collective node -> its trap (None: outside)
    bucket_plan: BucketPlan | None = None  # when static_shapes is on
    offload: OffloadSchedule | None = None  # when weights are offloaded

    def modules_of(self, node: torch.fx.Node) -> list[str]:
        return self.node_modules.get(node.name, [])

    def tensor_for(self, fqn: str) -> TensorOwnership | None:
        for t in self.tensors.values():
            if fqn in t.fqns:
                return t
        return None

    def weights(self) -> list[TensorOwnership]:
        return [t for t in self.tensors.values() if t.is_weight]

    @property
    def total_weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.weights())

    @property
    def distributed(self) -> bool:
        """Whether any tensor input is sharded or replicated by torch.distributed (DTensor, FSDP2, DDP)."""
        return any(t.placement is not None for t in self.tensors.values())


# --------------------------------------------------------------------------------------------
# torch.distributed: collectives, placements and meshes as text
# --------------------------------------------------------------------------------------------

_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "_dtensor")
_COLLECTIVE_METHODS = {"redistribute"}


def is_collective(node: torch.fx.Node) -> bool:
    """A communication node: a functional collective or its wait (``_c10d_functional.all_reduce``,
    ``wait_tensor``, ...) or a DTensor redistribution (``x.redistribute(...)`` at Dynamo level)."""
    if node.op == "call_method":
        return node.target in _COLLECTIVE_METHODS
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return op_name(target).namespace in _COLLECTIVE_NAMESPACES
    module = getattr(target, "__module__", "") or ""
    return module.startswith("torch.distributed._functional_collectives") or op_name(target).name in (
        "redistribute",
        "prim_redistribute",
    )


def placement_text(placements, mesh) -> str:
    """``(Shard(dim=0),)`` -> ``Shard(0)``; on a mesh with named dims, ``dp=Shard(0), tp=Replicate()``."""
    parts = []
    for p in placements:
        name = type(p).__name__
        if hasattr(p, "dim") and "Shard" in name:
            parts.append(f"{name}({p.dim})")
        elif hasattr(p, "reduce_op"):
            parts.append(f"{name}({p.reduce_op})")
        else:
            parts.append(f"{name}()")
    names = getattr(mesh, "mesh_dim_names", None)
    if names and len(names) == len(parts):
        parts = [f"{n}={p}" for n, p in zip(names, parts)]
    return ", ".join(parts)


def mesh_text(mesh) -> str:
    """A DeviceMesh as ``cpu[0, 1]`` or ``cpu[[0, 1], [2, 3]] (dp, tp)``."""
    ranks = mesh.mesh.tolist()
    names = getattr(mesh, "mesh_dim_names", None)
    return f"{mesh.device_type}{ranks}" + (f" ({', '.join(names)})" if names else "")
