"""``StaticShapesConfig``: the ``static_shapes`` option (dims, buckets, mask contract, pad values, checked mode),
validated; and :func:`check_buckets`, the one check of a bucket list (also used by
:func:`~graphpass.static_shapes.choose_buckets` and :class:`~graphpass.static_shapes.BucketedCache`); and
:func:`pads_on_host`, whether a tensor's padding runs on the host (a lazy-tensor device), read by the dispatcher
and by the padding proof's per-call checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class StaticShapesConfig:
    """``static_shapes={"dims": {"input_ids": 1}, "buckets": [16, 32, 64]}``.

    dims: input name -> the dim(s) that vary; every tensor input sized by the same symbol is padded too.
    buckets: strictly increasing sizes; a call runs the graph of the smallest bucket that fits.
    masked: inputs whose padding the model masks itself (a mask contract): the padding-safety
        analysis is skipped for graphs that vary only through them.
    pad_value: value written into the padding, per input (default 0).
    verify: checked mode: the first call of each bucket runs a second time with another padding fill and
        the real rows of the outputs are compared: ``True``, bitwise or within the dtype's rounding (padding
        tokens routed to a mixture of experts change its GEMMs' row counts, so their rounding); ``"bitwise"``,
        bitwise only. A mismatch refuses that bucket (its calls run unpadded), with a warning naming it.
    """

    dims: Mapping[str, tuple[int, ...]]
    buckets: tuple[int, ...]
    masked: tuple[str, ...] = ()
    pad_value: Mapping[str, float] = field(default_factory=dict)
    verify: bool | str = False  # False, True or "bitwise"

    @property
    def largest(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, size: int) -> int | None:
        return next((b for b in self.buckets if b >= size), None)


def check_buckets(key: str, buckets: Any) -> tuple[int, ...]:
    """A bucket list as ``static_shapes["buckets"]`` takes it: a non-empty list (or tuple) of
    strictly increasing positive ints. Returns it as a tuple; raises ConfigError naming ``key``."""
    if not isinstance(buckets, (list, tuple)) or not buckets:
        raise ConfigError(key, buckets, "expected a non-empty list of sizes")
    if not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in buckets):
        raise ConfigError(key, buckets, "bucket sizes must be positive integers")
    if any(b >= c for b, c in zip(buckets, buckets[1:])):
        raise ConfigError(key, buckets, "bucket sizes must be strictly increasing")
    return tuple(buckets)


def check_static_shapes(value: Any) -> StaticShapesConfig | None:
    key = "static_shapes"
    if value is None:
        return None
    if isinstance(value, StaticShapesConfig):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(key, value, f"expected a dict with 'dims' and 'buckets', not {type(value).__name__}")
    allowed = {"dims", "buckets", "masked", "pad_value", "verify"}
    for k in value:
        if k not in allowed:
            raise ConfigError(f"{key}.{k}", value[k], f"unknown key (known: {', '.join(sorted(allowed))})")
    dims = value.get("dims")
    if not isinstance(dims, Mapping) or not dims:
        raise ConfigError(f"{key}.dims", dims, "expected a non-empty dict input name -> dim (or list of dims)")
    norm_dims: dict[str, tuple[int, ...]] = {}
    for name, d in dims.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"{key}.dims", name, "input names must be Python identifiers (forward's parameter names)")
        ds = (d,) if isinstance(d, int) and not isinstance(d, bool) else d
        if (
            not isinstance(ds, (list, tuple))
            or not ds
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ds)
        ):
            raise ConfigError(f"{key}.dims.{name}", d, "expected a dim index >= 0 or a list of them")
        norm_dims[name] = tuple(ds)
    buckets = check_buckets(f"{key}.buckets", value.get("buckets"))
    masked = value.get("masked", ())
    if isinstance(masked, str) or not isinstance(masked, (list, tuple)) or not all(m in norm_dims for m in masked):
        raise ConfigError(f"{key}.masked", masked, "expected a list of names that appear in 'dims'")
    pad = value.get("pad_value", {})
    if not isinstance(pad, Mapping) or not all(
        k in norm_dims and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in pad.items()
    ):
        raise ConfigError(f"{key}.pad_value", pad, "expected a dict input name (from 'dims') -> number")
    verify = value.get("verify", False)
    if not isinstance(verify, bool) and verify != "bitwise":
        raise ConfigError(f"{key}.verify", verify, "expected True, False or 'bitwise'")
    return StaticShapesConfig(norm_dims, tuple(buckets), tuple(masked), dict(pad), verify)


LAZY_DEVICE_TYPES = ("xla", "lazy")  # devices where every eager op is traced and compiled for its shapes


def pads_on_host(t: Any) -> bool:
    """Whether ``t`` lives on a lazy-tensor device, where padding and slicing run on the host."""
    return isinstance(t, torch.Tensor) and t.device.type in LAZY_DEVICE_TYPES
