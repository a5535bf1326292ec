"""The analysis object every pass shares: which tensor input belongs to which module and trap.

Built by :mod:`graphpass.passes.analyze_ownership` and :mod:`graphpass.passes.assign_traps` from
the graph alone: placeholder sources give each input's fully qualified name, ``nn_module_stack``
gives the module every op ran in. No hooks, no tracing modes, no warm-up runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .passes.insert_offload_schedule import OffloadSchedule
    from .passes.plan_static_shapes import BucketPlan
    from .roots import Roots

# --------------------------------------------------------------------------------------------
# Names: Dynamo source strings and nn_module_stack paths -> module FQNs
# --------------------------------------------------------------------------------------------

_ROOT = re.compile(r"^(?:L|G)\[(?:'([^']*)'|\"([^\"]*)\")\]")
_TOKEN = re.compile(r"\.([A-Za-z0-9_]+)|\[(?:'([^']*)'|\"([^\"]*)\"|(-?\d+))\]")
_CONTAINERS = {"_modules": "module", "_parameters": "parameter", "_buffers": "buffer"}


@dataclass(frozen=True)
class ParsedSource:
    root: str  # the local or global the path starts from ("self", "model", "x", ...)
    is_global: bool
    path: tuple[str, ...]  # attribute / key path below the root, containers removed
    kind: str  # "parameter" | "buffer" | "inner" | "attribute" | "input"
    parent: tuple[str, ...] | None  # for "inner": the path of the parameter/buffer it hangs off

    @property
    def fqn(self) -> str:
        return ".".join(self.path)


def parse_source_name(name: str) -> ParsedSource | None:
    """Parse a Dynamo source name such as ``L['self']._modules['layers']._modules['0']._parameters['w'].scale``."""
    m = _ROOT.match(name)
    if not m:
        return None
    root = m.group(1) if m.group(1) is not None else m.group(2)
    pos = m.end()
    path: list[str] = []
    kind = "attribute"
    parent: tuple[str, ...] | None = None
    pending: str | None = None
    while pos < len(name):
        t = _TOKEN.match(name, pos)
        if not t:
            return None  # a source shape we do not understand (calls, slices, ...)
        pos = t.end()
        attr = t.group(1)
        key = next((g for g in t.groups()[1:] if g is not None), None)
        if attr is not None and attr in _CONTAINERS and pending is None:
            pending = _CONTAINERS[attr]
            continue
        part = attr if attr is not None else key
        if pending in ("parameter", "buffer"):
            kind = pending
        elif kind in ("parameter", "buffer", "inner"):
            if kind != "inner":
                parent = tuple(path)
            kind = "inner"
        pending = None
        path.append(part)
    if not path:
        kind = "input"
    return ParsedSource(root=root, is_global=name.startswith("G"), path=tuple(path), kind=kind, parent=parent)


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
    shape: tuple = ()
    dtype: str = ""
    nbytes: int = 0

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
