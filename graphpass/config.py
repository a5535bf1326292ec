"""Typed, validated configuration.

``torch.compile(..., backend="graphpass", options={...})`` and ``graphpass.backend(**kwargs)`` take
the same keys; both go through :meth:`GraphpassConfig.from_options`, which rejects unknown keys,
wrong types and bad patterns with a :class:`~graphpass.errors.ConfigError` naming the key and value.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from .errors import ConfigError
from .patterns import ModulePattern, compile_patterns
from .static_shapes.config import StaticShapesConfig, check_buckets, check_static_shapes  # noqa: F401 (re-exported)

_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class GraphpassConfig:
    """What one graphpass backend instance does.

    then: the delegate compiler: a registered backend name (``"inductor"``, ``"eager"``,
        ``"aot_eager"``, ``"cudagraphs"``, ...), ``"neuronx_cc"``/``"neuron"``, ``"openxla"``/``"openxla_eval"``
        (split at graphpass's ops like Neuron), or a backend callable.
    traps: module patterns whose matching modules become traps; ``None`` finds the repeated
        blocks automatically; ``[]`` makes no traps.
    boundaries: insert the trap enter/exit nodes into the graph (ownership is analysed either way).
    profile_ranges: the boundary nodes open a ``record_function`` range named after the trap
        while a profiler is running.
    mode: ``torch.compile`` mode, passed on to the delegate.
    delegate_options: extra options for the delegate (inductor config patches, or the
        ``options=`` of a registered backend).
    static_shapes: pad varying input dims to buckets, one static graph per bucket
        (:class:`StaticShapesConfig`).
    """

    then: Any = "inductor"
    traps: tuple[ModulePattern, ...] | None = None
    boundaries: bool = True
    profile_ranges: bool = True
    mode: str | None = None
    delegate_options: Mapping[str, Any] = field(default_factory=dict)
    static_shapes: StaticShapesConfig | None = None

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None, **kwargs: Any) -> "GraphpassConfig":
        merged: dict[str, Any] = {}
        if options is not None:
            if not isinstance(options, Mapping):
                raise ConfigError("options", options, f"expected a dict, not {type(options).__name__}")
            merged.update(options)
        for k, v in kwargs.items():
            if k in merged and merged[k] != v:
                raise ConfigError(k, v, f"given twice with different values ({merged[k]!r} in options)")
            merged[k] = v
        known = cls.keys()
        for key in merged:
            if not isinstance(key, str):
                raise ConfigError(str(key), merged[key], "option keys must be strings")
            if key not in known:
                hint = difflib.get_close_matches(key, known, n=1)
                extra = f"; did you mean {hint[0]!r}?" if hint else ""
                raise ConfigError(key, merged[key], f"unknown option (known: {', '.join(known)}){extra}")
        then = _check_then(merged.get("then", "inductor"))
        delegate_options = _check_mapping("delegate_options", merged.get("delegate_options", {}))
        _check_delegate_options(then, delegate_options)
        return cls(
            then=then,
            traps=_check_traps(merged.get("traps", None)),
            boundaries=_check_bool("boundaries", merged.get("boundaries", True)),
            profile_ranges=_check_bool("profile_ranges", merged.get("profile_ranges", True)),
            mode=_check_mode(merged.get("mode", None)),
            delegate_options=delegate_options,
            static_shapes=check_static_shapes(merged.get("static_shapes", None)),
        )


def _check_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, value, f"expected True or False, not {type(value).__name__}")
    return value


def _check_mode(value: Any) -> str | None:
    if value not in _MODES:
        raise ConfigError("mode", value, f"expected one of {', '.join(repr(m) for m in _MODES)}")
    return value


def _check_mapping(key: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(key, value, f"expected a dict, not {type(value).__name__}")
    for k in value:
        if not isinstance(k, str):
            raise ConfigError(key, value, f"keys must be strings, found {k!r}")
    return dict(value)


def _check_traps(value: Any) -> tuple[ModulePattern, ...] | None:
    if value is None or value == "auto":
        return None
    return compile_patterns(value, "traps")


def _check_delegate_options(then: Any, options: Mapping[str, Any]) -> None:
    """For inductor, every key must be an inductor config key (``max_autotune``, ``triton.cudagraphs``):
    checked now, not after the pipeline ran. A delegate that takes no options (``eager``, ``aot_eager``,
    a callable without an ``options`` parameter, a Delegate instance) refuses them; others take them as
    they are."""
    if not options:
        return
    if then != "inductor":
        from graphpass.backends import why_no_options

        reason = why_no_options(then)
        if reason is not None:
            key = next(iter(options))
            raise ConfigError(f"delegate_options.{key}", options[key], f"{reason} (given: {', '.join(options)})")
        return
    import torch._inductor.config as inductor_config

    known = set(inductor_config.get_config_copy())
    for key in options:
        if key not in known:
            hint = difflib.get_close_matches(str(key), known, n=1)
            extra = f"; did you mean {hint[0]!r}?" if hint else ""
            raise ConfigError(f"delegate_options.{key}", options[key], f"not an inductor config key{extra}")


def _check_then(value: Any) -> Any:
    # Resolution (registered names, adapters, callables) happens in graphpass.backends; here only
    # the type is checked, and names are checked against the registry right away.
    from graphpass.backends import Delegate, check_delegate_spec

    if value is None:
        raise ConfigError("then", value, "a delegate is required (default 'inductor')")
    if isinstance(value, (str, Delegate)) or callable(value):
        check_delegate_spec(value)
        return value
    raise ConfigError("then", value, f"expected a backend name or a backend callable, not {type(value).__name__}")
