"""The delegate table: what ``then="<name>"`` resolves to, one entry per kind of delegate (the shape of
torch's ``torch/_dynamo/backends/registry.py``, ``register_backend``).

An entry (:class:`DelegateEntry`) gives

* the name(s) ``then=`` accepts (the first is the delegate's own name, the others aliases);
* a factory, ``factory(name=..., mode=..., options=...) -> Delegate``, called for every resolution (the
  name ``then=`` used, the ``torch.compile`` mode, ``delegate_options``): a fresh delegate per backend;
* whether the delegate takes ``delegate_options`` (``takes_options``): when not, options given with it are
  refused when the backend is configured, before anything compiles;
* whether it can run host code (``host_code``): graph pieces only the host runs (graphpass's ops, custom ops
  without an aten decomposition: :func:`graphpass.delegation.runs_on_host`). A delegate without it gets the
  graph split there, its pieces compiled, the host nodes run as Python between them. The entry decides: the
  factory's delegate is given the entry's value;
* ``by_function``: ``then=`` may also be the function Dynamo registers under one of the names (torch's
  ``openxla``), which resolves to this entry rather than to a plain callable.

Adding a delegate is one call, :func:`register_delegate` (or ``@register_delegate(...)`` on the factory),
where the delegate is defined. The table holds kinds of delegates, as torch's holds backends: no model,
graph or compiled code; every resolution makes its own delegate. A name is registered once: a second
registration of it is refused (:class:`~graphpass.errors.DelegateRegistrationError`), as torch refuses a
duplicate backend name; :func:`unregister_delegate` removes an entry again (a test's own delegate).
Names the table does not hold fall through to Dynamo's registry (``"eager"``, ``"aot_eager"``, entry
points), resolved in :mod:`graphpass.backends`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from graphpass.errors import DelegateError, DelegateRegistrationError

from .base import Delegate

__all__ = [
    "DelegateEntry",
    "register_delegate",
    "unregister_delegate",
    "delegate_entry",
    "delegate_names",
    "entry_for_function",
    "make_delegate",
]

RESERVED = ("graphpass",)  # graphpass cannot delegate to itself by name


@dataclass(frozen=True)
class DelegateEntry:
    """One kind of delegate in the table (see the module docstring)."""

    names: tuple[str, ...]
    factory: Callable[..., Delegate]
    takes_options: bool
    host_code: bool
    by_function: bool = False

    @property
    def name(self) -> str:
        return self.names[0]


_LOCK = threading.Lock()
_TABLE: dict[str, DelegateEntry] = {}  # every name (aliases included) -> its entry, in registration order


def register_delegate(
    names: str | tuple[str, ...] | list[str],
    factory: Callable[..., Delegate] | None = None,
    *,
    takes_options: bool,
    host_code: bool,
    by_function: bool = False,
) -> Any:
    """Add a kind of delegate to the table under ``names`` (one name or several). Returns its
    :class:`DelegateEntry`; without ``factory``, a decorator that registers the factory it decorates and
    returns it unchanged (``@register_delegate("mine", takes_options=False, host_code=True)``).

    Raises :class:`~graphpass.errors.DelegateRegistrationError` for a name already in the table, a reserved
    or empty name, a factory that is not callable, or flags that are not ``True``/``False``."""
    if factory is None:

        def decorate(fn: Callable[..., Delegate]) -> Callable[..., Delegate]:
            register_delegate(names, fn, takes_options=takes_options, host_code=host_code, by_function=by_function)
            return fn

        return decorate
    entry = DelegateEntry(_check_names(names), factory, takes_options, host_code, by_function)
    _check_entry(entry)
    with _LOCK:
        taken = [n for n in entry.names if n in _TABLE]
        if taken:
            raise DelegateRegistrationError(
                f"delegate name {taken[0]!r} is already registered (by {_TABLE[taken[0]].factory!r}); names are "
                f"unique in the delegate table: choose another name or unregister_delegate({taken[0]!r}) first"
            )
        for name in entry.names:
            _TABLE[name] = entry
    return entry


def unregister_delegate(name: str) -> DelegateEntry:
    """Remove the entry registered under ``name`` (with all its names) and return it."""
    with _LOCK:
        entry = _TABLE.get(name)
        if entry is None:
            raise DelegateRegistrationError(
                f"no delegate is registered as {name!r} (registered: {', '.join(_TABLE) or 'none'})"
            )
        for alias in entry.names:
            del _TABLE[alias]
    return entry


def delegate_entry(name: str) -> DelegateEntry | None:
    """The entry ``then=name`` resolves to, or None (then Dynamo's registry is asked)."""
    return _TABLE.get(name)


def delegate_names() -> tuple[str, ...]:
    """Every name in the table, aliases included, in registration order."""
    return tuple(_TABLE)


def entry_for_function(fn: Any) -> tuple[str, DelegateEntry] | None:
    """``(name, entry)`` when ``fn`` is the function Dynamo registers under a name of a ``by_function``
    entry (``then=torch._dynamo.backends.torchxla.openxla``: the same bridge, reached without its name)."""
    candidates = [(n, e) for n, e in list(_TABLE.items()) if e.by_function]
    if not candidates:
        return None
    from torch._dynamo.backends.registry import _COMPILER_FNS, _lazy_import

    _lazy_import()
    return next(((n, e) for n, e in candidates if _COMPILER_FNS.get(n) is fn), None)


def make_delegate(
    entry: DelegateEntry, name: str, mode: str | None = None, options: Mapping[str, Any] | None = None
) -> Delegate:
    """The entry's delegate for ``then=name``: its factory's, given the entry's ``host_code``."""
    delegate = entry.factory(name=name, mode=mode, options=dict(options or {}))
    if not isinstance(delegate, Delegate):
        raise DelegateError(
            f"the factory of the delegate {name!r} ({entry.factory!r}) returned "
            f"{type(delegate).__name__}, not a graphpass.backends.Delegate"
        )
    if delegate.host_code != entry.host_code:
        delegate.host_code = entry.host_code  # the table says where the graph is split
    return delegate


def _check_names(names: Any) -> tuple[str, ...]:
    found = (names,) if isinstance(names, str) else tuple(names) if isinstance(names, (tuple, list)) else None
    if not found:
        raise DelegateRegistrationError(f"a delegate needs a name or a tuple of names, not {names!r}")
    for name in found:
        if not isinstance(name, str) or not name or name != name.strip():
            raise DelegateRegistrationError(
                f"a delegate name must be a non-empty string without surrounding spaces, not {name!r}"
            )
        if name in RESERVED:
            raise DelegateRegistrationError(
                f"the delegate name {name!r} is reserved: graphpass cannot delegate "
                "to itself by name (pass graphpass.backend(...) as then=)"
            )
    if len(set(found)) != len(found):
        raise DelegateRegistrationError(f"a delegate's names are given twice: {found!r}")
    return found


def _check_entry(entry: DelegateEntry) -> None:
    if not callable(entry.factory):
        raise DelegateRegistrationError(
            f"the factory of the delegate {entry.name!r} must be callable "
            f"(factory(name=, mode=, options=) -> Delegate), not {entry.factory!r}"
        )
    for flag in ("takes_options", "host_code", "by_function"):
        if not isinstance(getattr(entry, flag), bool):
            raise DelegateRegistrationError(
                f"{flag} of the delegate {entry.name!r} must be True or False, not {getattr(entry, flag)!r}"
            )
