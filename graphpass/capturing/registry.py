"""``TensorRegistry``: the tensors one forward captured, in registration order (what ``graphpass::capture`` fills).

A registry made for a ``ModelCapture`` knows that capture's module (``model``): the capture op
asks it (:meth:`TensorRegistry.resolve`) whether the weights a capture node passes as its owner
are that model's, and under which module name. See :mod:`graphpass.capturing.ops`. The answer
for one capture site (node name, traced owner FQN, owner tensor objects) is kept in the
:class:`CaptureSites` the ``ModelCapture`` shares with all its registries, and checked on each
later call with two dict look-ups per owner (does ``model`` still hold that tensor at that FQN?):
the full look-up (a table of every weight of the model) runs once per site, not once per call.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from ..fx_utils import holds_at, owned_tensors, relocated, tensor_keys
from ..patterns import ModulePattern


class Switch:
    """An on/off flag several registries share (a ``ModelCapture``'s per-context registries)."""

    __slots__ = ("on",)

    def __init__(self, on: bool = True) -> None:
        self.on = bool(on)


class CaptureSites:
    """Per ``ModelCapture`` (never shared by two models): resolved capture sites and which names
    its patterns accept. ``sites``: ``(name, owner_fqn, id(owner)...) -> (resolved name, the FQN
    of each owner tensor in the model)``; an entry is used only while the model still holds each
    owner tensor at its FQN (:func:`graphpass.fx_utils.holds_at`), so a weight swapped or a
    different instance running the same graph falls back to the full look-up."""

    MAX_SITES = 4096  # tensor objects made per call would add entries: start over past this

    __slots__ = ("sites", "accepted")

    def __init__(self) -> None:
        self.sites: dict[tuple, tuple[str, tuple[str, ...]]] = {}
        self.accepted: dict[str, bool] = {}

    def remember(self, key: tuple, resolved: str, fqns: tuple[str, ...]) -> None:
        if len(self.sites) >= self.MAX_SITES:
            self.sites.clear()
        self.sites[key] = (resolved, fqns)


class TensorRegistry:
    """Holds the tensors captured during one forward, in registration order.

    ``switch``: share the enabled flag with other registries (``configure`` on one turns all on or
    off); by default each registry has its own.
    """

    def __init__(
        self,
        enabled: bool = True,
        patterns: Sequence[ModulePattern] = (),
        *,
        switch: Switch | None = None,
        model: torch.nn.Module | None = None,
        sites: CaptureSites | None = None,
    ) -> None:
        self._switch = switch if switch is not None else Switch(enabled)
        self._sites = sites if sites is not None else CaptureSites()  # shared by a ModelCapture's registries
        self.patterns = tuple(patterns)  # module captures this registry accepts (empty: all)
        self.bucket: int | None = None  # static-shape bucket the captured tensors were padded to
        self._entries: list[tuple[str, torch.Tensor, bool, str, str]] = []  # (name, value, manual, key, layout)
        # The module whose weights identify this registry's captures (None: accept by name only).
        self.model = model
        self._owned: dict[Hashable, list[str]] | None = None  # tensor key -> its FQNs in ``model``
        self._not_owned: set[Hashable] = set()  # keys looked up again after a rebuild, still not owned
        self.problems: list[str] = []  # captures this registry's model ran but that could not be named
        self._names: dict[int, str] | None = None  # id(module) -> its FQN in ``model`` (eager captures)

    def accepts(self, name: str) -> bool:
        known = self._sites.accepted.get(name)
        if known is None:
            known = self._sites.accepted[name] = not self.patterns or any(p.matches(name) for p in self.patterns)
        return known

    # -- owner routing ---------------------------------------------------------------------------
    def owner_fqns(self, t: torch.Tensor) -> list[str] | None:
        """The FQNs under which ``model`` holds ``t`` (a parameter or buffer, or an inner tensor of
        one), or None when ``model`` does not hold it. The table is built on first use in a step
        (the weights a step runs with) and rebuilt once for a tensor it does not know, in case the
        model's tensors were replaced since (e.g. parameters swapped in by a wrapper's pre-forward)."""
        keys = tensor_keys(t)
        if self._owned is None:
            self._owned = owned_tensors(self.model)
        for k in keys:
            if k in self._owned:
                return self._owned[k]
        if keys[0] in self._not_owned:
            return None
        self._owned = owned_tensors(self.model)
        for k in keys:
            if k in self._owned:
                return self._owned[k]
        self._not_owned.add(keys[0])
        return None

    def resolve(self, name: str, owner: Sequence[torch.Tensor], owner_fqn: str) -> str | None:
        """The name, relative to ``model``, of a module capture whose graph passed ``owner`` (weights
        of the instance that ran) and was traced with ``owner[0]`` at ``owner_fqn`` and the module at
        ``name``; None when ``model`` does not hold every owner tensor (another model's value)."""
        if self.model is None:
            return name
        key = (name, owner_fqn, *map(id, owner))
        hit = self._sites.sites.get(key)
        if hit is not None and all(holds_at(self.model, f, o) for f, o in zip(hit[1], owner)):
            return hit[0]
        resolved = self._resolve(name, owner, owner_fqn)
        if resolved is not None:
            self._sites.remember(key, resolved, tuple(self.owner_fqns(o)[0] for o in owner))
        return resolved

    def _resolve(self, name: str, owner: Sequence[torch.Tensor], owner_fqn: str) -> str | None:
        """:meth:`resolve` from the table of every weight of ``model`` (the first call of a site)."""
        fqns = self.owner_fqns(owner[0])
        if fqns is None or any(self.owner_fqns(o) is None for o in owner[1:]):
            return None
        if not owner_fqn or owner_fqn in fqns:
            return name
        # The graph was traced for another instance or another place: the module sits where
        # the owner weight sits now, relative to the module both have in common.
        found = relocated(name, owner_fqn, fqns)
        if len(found) == 1 and found[0]:
            return found[0]
        self.problems.append(
            f"a value of module {name!r} (traced with its weight {owner_fqn!r}) ran with a weight this model "
            f"holds as {', '.join(map(repr, fqns))}: cannot tell which module produced it"
        )
        return None

    def module_name(self, module: torch.nn.Module) -> str | None:
        """``module``'s FQN in ``model`` (``""``: the model itself), None when ``model`` does not
        hold it or this registry has no model. The table is built on first use in a step."""
        if self.model is None:
            return None
        if self._names is None:
            self._names = {id(m): n for n, m in self.model.named_modules()}
        return self._names.get(id(module))

    @property
    def enabled(self) -> bool:
        return self._switch.on

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._switch.on = bool(value)

    def configure(self, enabled: bool = True) -> None:
        self.enabled = bool(enabled)

    def register_module_tensor(self, name: str, tensor: torch.Tensor, key: str = "", layout: str = "") -> None:
        """``key``: the tensor's key path in the module's output (``[0]``, ``.last_hidden_state``,
        ``output``); ``""`` for a value computed in the module and read outside it but not returned.
        ``layout``: for a DTensor's local shard, its placement as JSON (:func:`ops.dtensor_layout`)."""
        if self.enabled:
            self._entries.append((name, tensor, False, key, layout))

    def register_manual_tensor(self, name: str, tensor: torch.Tensor, layout: str = "") -> None:
        if self.enabled:
            self._entries.append((name, tensor, True, "", layout))

    def get_all_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``[(name, tensor), ...]`` in the order they were registered."""
        return [(n, t) for n, t, _, _, _ in self._entries]

    def get_all_entries(self) -> list[tuple[str, torch.Tensor, str | None, str]]:
        """``[(name, tensor, key, layout), ...]`` in registration order; ``key`` is the output key
        path of a module value (``""``: computed in the module, read outside, not returned), None
        for an inline ``capture_tensor`` value; ``layout`` a DTensor shard's placement JSON or ``""``.
        What :meth:`CaptureWriter.write` takes."""
        return [(n, t, None if manual else key, layout) for n, t, manual, key, layout in self._entries]

    def clear(self) -> None:
        self._entries = []
        self.bucket = None
        self._owned = None
        self._not_owned = set()
        self._names = None
        self.problems = []

    @property
    def module_tensor_count(self) -> int:
        """How many module (not inline ``capture_tensor``) values were captured."""
        return sum(1 for _, _, manual, _, _ in self._entries if not manual)

    def __len__(self) -> int:
        return len(self._entries)
