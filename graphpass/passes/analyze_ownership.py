"""Ownership analysis: inserts nothing; fills ``ctx.analysis.tensors``.

For every tensor input of the graph it records the fully qualified name(s) read off the
placeholder's Dynamo source (``L['self']._modules['layers']._modules['3']._parameters['w']`` ->
``layers.3.w``; ``...['weight'].scale`` -> the inner field ``weight.scale`` owned with its parent;
a tensor subclass wrapping inner tensors, such as torchao's ``Int8Tensor``, is one input whose
``inner`` lists them, ``weight.qdata``, and whose bytes are theirs),
the modules that hold it, the modules whose ops consume it (their ``nn_module_stack``, followed
through view-like nodes that carry no stack, into custom ops too) and its size. A tied weight is
one input with several FQNs and owners; its other names come from the module Dynamo reached it
through, compared by identity.

Under ``torch.distributed`` it also records each tensor's placement and mesh: a DTensor input's own
(the real example input, else the placeholder's example value), bytes of its local shard on this
rank and of the whole tensor; an FSDP2 parameter (gathered before the graph runs) its at-rest shard;
a DDP model's parameters are replicated over its process group.

Assumes a Dynamo-level graph (placeholders carry ``grapharg``); a graph without sources (for
example one handed over by another backend) still gets consumers and sizes, named by placeholder.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..analysis import TensorOwnership, mesh_text, module_paths, placement_text
from ..fx_utils import (
    example_of,
    inner_tensor_fields,
    is_graphpass_node,
    is_graphpass_op,
    node_order,
    wrapper_inner_tensors,
)
from ..roots import parse_source_name
from ..tensor_utils import dtensor_class, dtensor_mesh, dtensor_placements, fsdp_param_groups, local_tensor
from ..torch_compat import source_name
from .base import GraphPass, PassContext


def _source_name(node: torch.fx.Node) -> str | None:
    ga = node.meta.get("grapharg")
    src = getattr(ga, "source", None)
    if src is None:
        return None
    return source_name(src)


def _nbytes(t: torch.Tensor) -> int:
    try:
        return int(t.numel()) * t.element_size()
    except Exception:  # symbolic size without a hint
        return 0


def _shape(t: torch.Tensor) -> tuple:
    return tuple(int(s) if isinstance(s, int) else str(s) for s in t.shape)


class _Distributed:
    """Placement, mesh and at-rest bytes of tensors sharded or replicated by torch.distributed."""

    def __init__(self, roots) -> None:
        self._fsdp: dict[str, Any] | None = None  # FQN -> FSDP2's sharded (at rest) parameter
        self._ddp: dict[str, str] | None = None  # FQN -> DDP process group, as text
        self.roots = roots

    def annotate(self, t: TensorOwnership, value: torch.Tensor) -> None:
        cls = dtensor_class()
        dist = torch.distributed
        if cls is None and not (dist.is_available() and dist.is_initialized()):
            return  # nothing distributed in this process
        if cls is not None and isinstance(value, cls):
            t.placement = placement_text(dtensor_placements(value), dtensor_mesh(value))
            t.mesh = mesh_text(dtensor_mesh(value))
            t.sharded_by = "dtensor"
        sharded = next((self.fsdp()[f] for f in t.fqns if f in self.fsdp()), None)
        if sharded is not None:  # at rest an FSDP2 shard; the graph reads the gathered tensor
            t.placement = placement_text(dtensor_placements(sharded), dtensor_mesh(sharded))
            t.mesh = mesh_text(dtensor_mesh(sharded))
            t.sharded_by = "fsdp2"
            t.global_shape = _shape(sharded)
            t.global_nbytes = _nbytes(sharded)
            t.local_nbytes = _nbytes(local_tensor(sharded))
            return
        group = next((self.ddp()[f] for f in t.fqns if f in self.ddp()), None)
        if group is not None and t.placement is None:
            t.placement, t.mesh, t.sharded_by = "Replicate()", group, "ddp"

    def fsdp(self) -> dict[str, Any]:
        if self._fsdp is None:
            self._fsdp = {}
            for model in self.roots.whole_models():
                try:
                    self._fsdp.update(_fsdp_params(model))
                except Exception:  # FSDP2 internals of another torch release: no at-rest info
                    pass
        return self._fsdp

    def ddp(self) -> dict[str, str]:
        if self._ddp is None:
            self._ddp = {}
            ddp_class = getattr(sys.modules.get("torch.nn.parallel"), "DistributedDataParallel", None)
            for model in self.roots.whole_models():
                if ddp_class is None or not isinstance(model, ddp_class):
                    continue
                try:
                    ranks = torch.distributed.get_process_group_ranks(model.process_group)
                except Exception:
                    ranks = list(range(torch.distributed.get_world_size()))
                group = f"process group {ranks}"
                for name, _ in model.named_parameters(remove_duplicate=False):
                    self._ddp[name] = group
        return self._ddp


def _fsdp_params(model: torch.nn.Module) -> dict[str, Any]:
    """FQN -> the sharded parameter FSDP2 (``fully_shard``) keeps at rest, for every module it manages."""
    out: dict[str, Any] = {}
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    for module in model.modules():
        for fp in [fp for group in fsdp_param_groups(module) for fp in getattr(group, "fsdp_params", None) or []]:
            info = fp._module_info
            pairs = [(info.module, info.param_name)] + list(zip(info.shared_modules, info.shared_param_names))
            for holder, param_name in pairs:
                prefix = names.get(id(holder))
                if prefix is not None:
                    out[f"{prefix}.{param_name}" if prefix else param_name] = fp.sharded_param
    return out


def _alias_table(root: Any) -> dict[int, list[str]]:
    """id(tensor) -> every name it has in ``root`` (parameters, buffers, inner fields), tied ones included."""
    table: dict[int, list[str]] = {}
    if not isinstance(root, torch.nn.Module):
        return table
    named = list(root.named_parameters(remove_duplicate=False)) + list(root.named_buffers(remove_duplicate=False))
    for name, t in named:
        table.setdefault(id(t), []).append(name)
        for field_name, value in inner_tensor_fields(t):
            table.setdefault(id(value), []).append(f"{name}.{field_name}")
    return table


def _input_name(source: str, fallback: str) -> str:
    """``L['ids']`` -> ``ids``; ``L['args'][1]`` -> ``args[1]``; ``L['kwargs']['input_ids']`` -> ``kwargs['input_ids']``."""
    parsed = parse_source_name(source)
    if parsed is None:
        return fallback
    return parsed.root + "".join(f"[{p}]" if p.lstrip("-").isdigit() else f"[{p!r}]" for p in parsed.path)


class AnalyzeOwnership(GraphPass):
    name = "analyze_ownership"

    def run(self, ctx: PassContext) -> bool:
        analysis = ctx.analysis
        analysis.roots = ctx.roots
        module_names: dict[str, None] = {}
        for model in ctx.roots.whole_models():
            for name, _ in model.named_modules(remove_duplicate=False):
                if name:
                    module_names[name] = None
        analysis.node_modules.update(_node_modules(ctx))
        order = node_order(ctx.gm.graph)
        names = _Names(ctx.roots)
        dist_info = _Distributed(ctx.roots)
        placeholders = [n for n in ctx.gm.graph.nodes if n.op == "placeholder"]
        for index, ph in enumerate(placeholders):
            real = ctx.example_inputs[index] if index < len(ctx.example_inputs) else None
            value = real if isinstance(real, torch.Tensor) else example_of(ph)
            if not isinstance(value, torch.Tensor):
                continue  # SymInt sizes and other non-tensor inputs
            source = _source_name(ph) or ph.name
            kind, fqns, parent = names.of(source, ph.name, real)
            holders: list[str] = []
            if kind != "input":
                drop = 2 if kind == "inner" else 1  # inner fields hang off a parameter of the holder
                holders = list(dict.fromkeys(".".join(f.split(".")[:-drop]) for f in fqns))
                module_names.update((h, None) for h in holders if h)
            consumers, consumer_nodes = self._consumers(ph, order, analysis.node_modules)
            local = local_tensor(value)
            inner = wrapper_inner_tensors(local) if kind != "input" else []
            nbytes = (sum(_nbytes(v) for _, v in inner) if inner else _nbytes(local)) if kind != "input" else 0
            analysis.tensors[ph.name] = TensorOwnership(
                node=ph.name,
                index=index,
                source=source,
                kind=kind,
                fqns=fqns,
                parent=parent,
                holders=holders,
                consumers=consumers,
                shape=_shape(local),
                dtype=str(value.dtype).replace("torch.", ""),
                nbytes=nbytes,
                global_shape=_shape(value),
                global_nbytes=(nbytes if inner else _nbytes(value)) if kind != "input" else 0,
                local_nbytes=nbytes,
                inner=[name for name, _ in inner],
            )
            if kind != "input":
                dist_info.annotate(analysis.tensors[ph.name], value)
            analysis.consumer_nodes[ph.name] = consumer_nodes
        for paths in analysis.node_modules.values():
            module_names.update((path, None) for path in paths)
        analysis.module_names = list(module_names)
        return False  # analysis only

    @staticmethod
    def _consumers(ph: torch.fx.Node, order: dict, node_modules: dict) -> tuple[list[str], list[str]]:
        """Ops that read ``ph``: the first ones with a module stack, looking through stackless views."""
        modules: dict[str, None] = {}
        nodes: dict[torch.fx.Node, None] = {}
        seen = {ph}
        frontier = list(ph.users)
        while frontier:
            user = frontier.pop()
            if user in seen or user.op == "output":
                continue
            seen.add(user)
            if is_graphpass_node(user):
                continue
            paths = node_modules.get(user.name)
            if paths:
                nodes[user] = None
            else:
                frontier.extend(user.users)
        ordered = sorted(nodes, key=order.__getitem__)
        for n in ordered:
            modules[node_modules[n.name][-1]] = None
        return list(modules), [n.name for n in ordered]


def _node_modules(ctx: PassContext) -> dict[str, list[str]]:
    """Op node -> the module FQNs it ran in, outermost first."""
    out: dict[str, list[str]] = {}
    # A graph traced from a submodule's own frame (after a graph break) runs every op inside
    # that submodule, even ops of its forward that carry no nn_module_stack entry.
    frame_module = ctx.roots.frame_module
    for node in ctx.gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module") and not is_graphpass_op(node.target):
            paths = module_paths(node, ctx.roots)
            if frame_module:
                paths = [frame_module] + [p for p in paths if p != frame_module]
            out[node.name] = paths
    return out


class _Names:
    """Names a graph input by its Dynamo source: its kind, every FQN (tied names from the model,
    compared by identity) and, for an inner field, its parent's FQN."""

    def __init__(self, roots) -> None:
        self.roots = roots
        self._alias_tables: dict[int, dict[int, list[str]]] = {}

    def of(self, source: str, fallback: str, real: Any) -> tuple[str, list[str], str | None]:
        roots = self.roots
        parsed = parse_source_name(source)
        if parsed is not None:
            key, _ = roots.split(parsed)
            if roots.modules and key is None:
                parsed = None  # rooted at a plain local (an input), not at a module
            elif not roots.modules and parsed.root != "self" and parsed.kind == "attribute":
                parsed = None  # no frame to resolve against: only self.<...> is the model
        if parsed is None or not parsed.path:
            return "input", [_input_name(source, fallback)], None
        fqns = [roots.qualify(parsed)]
        parent = roots.qualify(parsed, parsed.parent) if parsed.parent is not None else None
        model = roots.model_for(parsed)
        if model is not None and isinstance(real, torch.Tensor):
            table = self._alias_tables.get(id(model))
            if table is None:
                table = self._alias_tables[id(model)] = _alias_table(model)
            fqns.extend(alias for alias in table.get(id(real), []) if alias not in fqns)
        return parsed.kind, fqns, parent
