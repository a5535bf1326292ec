"""Where a graph's sources start: the model object(s) behind ``L['self']``, ``L['args'][0]``, ...

Dynamo names every input by a source rooted at a local or global of the frame it traced. The
model may be that local (``self``), sit inside it (``args[0]`` when a decorator wrapped
``forward``), or be one layer of a bigger model running further up the Python stack (a frame
Dynamo compiled on its own after a graph break). :class:`Roots` maps each source root to the
module it reaches and that module's FQN in the whole model, by object identity: no hooks.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from .torch_compat import source_name

# --------------------------------------------------------------------------------------------
# Names: Dynamo source strings -> the path below their root (analysis.py re-exports them)
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
    via_dict = False  # the previous token was ``.__dict__``: its key is an attribute or a container
    while pos < len(name):
        t = _TOKEN.match(name, pos)
        if not t:
            return None  # a source shape we do not understand (calls, slices, ...)
        pos = t.end()
        attr = t.group(1)
        key = next((g for g in t.groups()[1:] if g is not None), None)
        if attr == "__dict__" and pending is None:
            # ``self.__dict__['_modules']['blocks']``: Dynamo's source when a class defines
            # ``__getattr__`` (diffusers' ModelMixin); the same module as ``self._modules['blocks']``
            via_dict = True
            continue
        container = attr if attr is not None else (key if via_dict else None)
        via_dict = False
        if container is not None and container in _CONTAINERS and pending is None:
            pending = _CONTAINERS[container]
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


RootKey = tuple[str, tuple[str, ...]]  # (local or global name, path from it to the module)


def _step(obj: Any, part: str) -> Any:
    if isinstance(obj, (tuple, list)) and part.lstrip("-").isdigit():
        return obj[int(part)]
    if isinstance(obj, dict):
        return obj[part]
    return getattr(obj, part)


@dataclass
class Roots:
    modules: dict[RootKey, torch.nn.Module] = field(default_factory=dict)  # root -> module it reaches
    prefixes: dict[RootKey, str] = field(default_factory=dict)  # root -> its FQN in the enclosing model
    models: dict[RootKey, torch.nn.Module] = field(default_factory=dict)  # root -> the enclosing model
    frame_name: str = ""  # name of the code object Dynamo traced ("forward", "torch_dynamo_resume_in_...")
    inside_model: bool = False  # a frame without a module ``self`` that runs inside a module's forward

    def split(self, parsed: ParsedSource) -> tuple[RootKey | None, tuple[str, ...]]:
        """(root key, path below the module) for a parsed source; key None when no module is known."""
        best: RootKey | None = None
        for key in self.modules:
            name, lead = key
            if name == parsed.root and parsed.path[: len(lead)] == lead and (best is None or len(lead) > len(best[1])):
                best = key
        if best is not None:
            return best, parsed.path[len(best[1]) :]
        if parsed.root in ("args", "kwargs") and parsed.path:
            return None, parsed.path[1:]  # no frame to look at: assume args[i] is the model
        return None, parsed.path

    def qualify(self, parsed: ParsedSource, path: tuple[str, ...] | None = None) -> str:
        """The FQN of ``path`` (default: the source's own path) in the whole model."""
        key, rest = self.split(parsed)
        if path is not None:
            rest = path[len(parsed.path) - len(rest) :]
        prefix = self.prefixes.get(key, "") if key is not None else ""
        return ".".join(p for p in (prefix, *rest) if p)

    def model_for(self, parsed: ParsedSource) -> torch.nn.Module | None:
        key, _ = self.split(parsed)
        if key is None:
            return None
        return self.models.get(key, self.modules.get(key))

    def whole_models(self) -> list[torch.nn.Module]:
        out: dict[int, torch.nn.Module] = {}
        for key, mod in self.modules.items():
            m = self.models.get(key, mod)
            out[id(m)] = m
        return list(out.values())

    @property
    def is_entry_frame(self) -> bool:
        """The graph starts where the user's compiled call starts (not a resume after a graph
        break, not a submodule's own frame): its inputs are the call's arguments."""
        return (
            not self.frame_name.startswith("torch_dynamo_resume_in") and not self.frame_module and not self.inside_model
        )

    @property
    def frame_module(self) -> str:
        """FQN of the module whose own forward frame this graph was traced from ("" at the top)."""
        return self.prefixes.get(("self", ()), "")


def source_names(gm: torch.fx.GraphModule) -> list[str]:
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        src = getattr(n.meta.get("grapharg"), "source", None)
        if src is None:
            continue
        out.append(source_name(src))
    return out


def dynamo_roots(gm: torch.fx.GraphModule) -> Roots:
    """Roots of ``gm``'s sources, resolved against the frame Dynamo is compiling (if any)."""
    roots = Roots()
    parsed = [p for p in (parse_source_name(n) for n in source_names(gm)) if p is not None and p.path]
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:
        tx = None
    if tx is None:
        return roots
    roots.frame_name = getattr(getattr(tx, "f_code", None), "co_name", "")
    # The frame's own module, even when no input is read through it (a graph of activations only,
    # after a break inside a layer): where it sits in the model says whether this is the call's entry.
    own = tx.f_locals.get("self")
    if isinstance(own, torch.nn.Module) and not isinstance(own, torch._dynamo.eval_frame.OptimizedModule):
        roots.modules.setdefault(("self", ()), own)
    for p in parsed:
        scope = tx.f_globals if p.is_global else tx.f_locals
        if p.root not in scope:
            continue
        obj = scope[p.root]
        lead: list[str] = []
        try:
            while not isinstance(obj, torch.nn.Module) and len(lead) < len(p.path):
                obj = _step(obj, p.path[len(lead)])
                lead.append(p.path[len(lead)])
        except Exception:
            continue
        if isinstance(obj, torch.nn.Module):
            roots.modules[(p.root, tuple(lead))] = obj
    _find_enclosing_models(roots)
    return roots


_MODULE_PY = os.path.join("torch", "nn", "modules", "module.py")  # Module.__call__'s frames: not a forward


def _find_enclosing_models(roots: Roots) -> None:
    """For root modules that are submodules of a model running further up the Python stack, record
    that model and the root's FQN in it. The outermost such model wins."""
    targets = dict(roots.modules)
    frame = sys._getframe(1)
    seen: set[int] = set()
    while frame is not None:
        owner = frame.f_locals.get("self")
        in_call_machinery = frame.f_code.co_filename.endswith(_MODULE_PY)
        frame = frame.f_back
        if not isinstance(owner, torch.nn.Module) or isinstance(owner, torch._dynamo.eval_frame.OptimizedModule):
            continue
        if ("self", ()) not in targets and not in_call_machinery:
            roots.inside_model = True  # a free function's frame, called from a module's own code
        if id(owner) in seen:
            continue
        seen.add(id(owner))
        wanted = {id(obj): key for key, obj in targets.items() if obj is not owner}
        if not wanted:
            continue
        for fqn, mod in owner.named_modules(remove_duplicate=False):
            key = wanted.get(id(mod))
            if key is not None and fqn:
                roots.prefixes[key] = fqn
                roots.models[key] = owner
