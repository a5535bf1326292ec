"""Model families for comparing an engine's captures with transformers' (``graphpass compare`` across
engines, :mod:`graphpass.comparing.compare_engines`): how one captured module of the engine becomes
transformers' module outputs.

A serving engine's modules are not transformers' modules. vLLM's Llama decoder layer returns
``(hidden_states, residual)`` and leaves the residual addition to the next layer's fused add-and-norm;
its attention projects q, k and v with one fused ``qkv_proj``, its MLP gate and up with one
``gate_up_proj``; its linear layers return ``(output, bias)``. A :class:`Family` holds a ``rebuild``
function that turns one engine module's captured tensors (key path -> tensor, rows = tokens) into
transformers' names and keys: ``{transformers_module: {key: tensor}}``.

Adding a family (docs/vllm.md, "Comparing with a reference")::

    from graphpass.comparing.engine_families import Family, register_family, rebuild_llama

    register_family(Family("qwen2", model_types=("qwen2",), rebuild=rebuild_llama))

``rebuild(module, tensors, shape)`` gets the engine module's name (``model.layers.3.self_attn.qkv_proj``),
one tensor-parallel rank's tensors by key path (``[0]``, ``[1]``, ``output``; the engine's ``other[...]``
keys, tensors it wrote in place, are dropped before) and the :class:`ModelShape` from the engine's meta,
with ``tp_rank`` set to that rank; it returns the transformers modules and their tensors by key
(``output`` for a module returning one tensor). A tensor that is the whole of transformers' tensor
(a decoder layer's output, which every rank holds after the all-reduce) is returned as is; a rank's
shard of it (a column-parallel projection's heads) as a :class:`Slice` saying where in transformers'
last dimension it lies. The registry is an instance (:class:`FamilyRegistry`); :data:`FAMILIES` is the
one ``compare`` reads. It is keyed by (engine, model_type): a family rebuilds the captures of one
engine (``Family.engine``, the engine step meta's ``engine``; default ``"vllm"``), so another engine's
family for the same ``model_type`` is registered beside vLLM's, never over it::

    register_family(Family("sglang-llama", ("llama",), rebuild_sglang_llama, engine="sglang"))
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..capture_format import DEFAULT_ENGINE, REFERENCE_ENGINE
from ..errors import ConfigError, GraphpassError  # noqa: F401
from ..model_shape import ModelShape, RebuildError  # noqa: F401 (re-exported)

__all__ = [
    "Family",
    "FamilyRegistry",
    "FAMILIES",
    "ModelShape",
    "RebuildError",
    "Slice",
    "register_family",
    "rebuild_llama",
]

_LAYER_RE = re.compile(r"(?:.*\.)?layers\.[0-9]+")  # a decoder layer: model.layers.3 (fullmatch)


@dataclass(frozen=True)
class Slice:
    """One tensor-parallel rank's shard of a transformers tensor: ``tensor`` (rows = tokens) is
    transformers' ``[..., start:start + tensor.shape[-1]]``."""

    tensor: torch.Tensor
    start: int

    @property
    def stop(self) -> int:
        return self.start + int(self.tensor.shape[-1])


Rebuild = Callable[[str, "dict[str, torch.Tensor]", ModelShape], "dict[str, dict[str, torch.Tensor]]"]


@dataclass(frozen=True)
class Family:
    """One model family: its name, the ``model_type`` values (transformers' config) it covers, its
    ``rebuild`` (see the module docstring) and the ``engine`` whose captures it rebuilds (the engine
    step meta's ``engine``; default ``"vllm"``, :data:`~graphpass.capture_format.DEFAULT_ENGINE`)."""

    name: str
    model_types: tuple[str, ...]
    rebuild: Rebuild
    engine: str = DEFAULT_ENGINE

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ConfigError("Family.name", self.name, "must be a non-empty str")
        if (
            isinstance(self.model_types, str)
            or not self.model_types
            or not all(isinstance(t, str) and t for t in self.model_types)
        ):
            raise ConfigError("Family.model_types", self.model_types, "must be a non-empty tuple of model_type strings")
        if not callable(self.rebuild):
            raise ConfigError("Family.rebuild", self.rebuild, "must be callable: rebuild(module, tensors, shape)")
        if not isinstance(self.engine, str) or not self.engine or self.engine == REFERENCE_ENGINE:
            raise ConfigError(
                "Family.engine",
                self.engine,
                "must be the name of the engine whose captures it rebuilds "
                f"(a non-empty str, not {REFERENCE_ENGINE!r}: the reference)",
            )


@dataclass
class FamilyRegistry:
    """(engine, model_type) -> :class:`Family`: each engine's families apart, so two engines' Llama
    (their modules are not the same) never collide."""

    by_key: dict[tuple[str, str], Family] = field(default_factory=dict)

    @property
    def by_type(self) -> dict[str, Family]:
        """model_type -> the family of :data:`DEFAULT_ENGINE` (vLLM): the table before it was keyed by engine."""
        return {t: f for (engine, t), f in self.by_key.items() if engine == DEFAULT_ENGINE}

    def register(self, family: Family, replace: bool = False) -> Family:
        if not isinstance(family, Family):
            raise ConfigError("family", family, "must be a graphpass.comparing.engine_families.Family")
        keys = [(family.engine, t) for t in family.model_types]
        taken = [k for k in keys if k in self.by_key and self.by_key[k].name != family.name]
        if taken and not replace:
            raise ConfigError(
                "Family.model_types",
                [t for _, t in taken],
                f"already registered for engine {family.engine!r} (family "
                f"{self.by_key[taken[0]].name!r}); pass replace=True to override",
            )
        for key in keys:
            self.by_key[key] = family
        return family

    def engines(self) -> list[str]:
        """The engines some family is registered for, sorted."""
        return sorted({engine for engine, _ in self.by_key})

    def lookup(self, model_type: str, engine: str = DEFAULT_ENGINE) -> Family:
        """The family of ``engine``'s captures of ``model_type`` (the engine step meta's ``engine``;
        :data:`DEFAULT_ENGINE` for a meta without one)."""
        try:
            return self.by_key[engine, model_type]
        except KeyError:
            known = sorted(t for e, t in self.by_key if e == engine)
            raise ConfigError(
                "model_type",
                model_type,
                f"has no registered family for engine {engine!r} (known: {', '.join(known) or 'none'}): "
                "register one with graphpass.comparing.engine_families.register_family "
                "(docs/vllm.md)",
            ) from None


def _main(module: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A module's main output: ``output`` (one tensor) or ``[0]`` (a linear's ``(out, bias)``, a
    fused norm's ``(normed, residual)``)."""
    for key in ("output", "[0]"):
        if key in tensors:
            return tensors[key]
    raise RebuildError(f"{module}: neither 'output' nor '[0]' among its keys {sorted(tensors)}")


def _split(
    module: str, t: torch.Tensor, names: list[str], sizes: list[int], starts: list[int], tp_size: int
) -> dict[str, dict[str, Any]]:
    """``t``'s last dim split into ``names`` of ``sizes``; with ``tp_size`` > 1 each piece is a
    :class:`Slice` starting at ``starts`` in transformers' tensor."""
    if t.shape[-1] != sum(sizes):
        raise RebuildError(
            f"{module}: last dim {t.shape[-1]} is not {' + '.join(map(str, sizes))} ({', '.join(names)})"
        )
    prefix = module.rpartition(".")[0]
    pieces = torch.split(t, sizes, dim=-1)
    return {
        f"{prefix}.{n}": {"output": piece if tp_size == 1 else Slice(piece, start)}
        for n, piece, start in zip(names, pieces, starts)
    }


def _qkv_sizes(shape: ModelShape) -> tuple[list[int], list[int]]:
    """Sizes of q, k, v in one rank's ``qkv_proj`` output and where they start in transformers' q, k, v,
    as vLLM's ``QKVParallelLinear`` shards them: ``heads / tp`` query heads per rank; ``kv / tp`` kv heads
    per rank, or with fewer kv heads than ranks one kv head per rank, replicated on ``tp / kv`` ranks."""
    heads, kv, dim = shape.need("num_attention_heads", "num_key_value_heads", "head_dim")
    tp, rank = shape.tp_size, shape.tp_rank
    if heads % tp or (kv % tp and tp % kv):
        raise RebuildError(f"{heads} attention heads and {kv} kv heads do not shard over {tp} tensor-parallel ranks")
    kv_here, replicas = max(1, kv // tp), max(1, tp // kv)
    q, k = heads // tp * dim, kv_here * dim
    return [q, k, k], [rank * q, rank // replicas * k, rank // replicas * k]


def rebuild_llama(
    module: str, tensors: dict[str, torch.Tensor], shape: ModelShape
) -> dict[str, dict[str, torch.Tensor]]:
    """vLLM's Llama-style modules in transformers' terms: a decoder layer's ``[0] + [1]`` (hidden +
    residual); ``qkv_proj`` split into ``q_proj``, ``k_proj``, ``v_proj`` (heads x head_dim, kv heads x
    head_dim, per tensor-parallel rank); ``gate_up_proj`` into ``gate_proj``, ``up_proj``; any other
    module its main output (:func:`_main`) as ``output``. With ``tp_size`` > 1 the split pieces are
    :class:`Slice` s of rank ``tp_rank`` (vLLM's column-parallel shards); everything else is whole on
    every rank (decoder layers, ``o_proj`` and ``down_proj`` after their all-reduce, norms)."""
    if _LAYER_RE.fullmatch(module):
        if "[0]" in tensors and "[1]" in tensors:
            return {module: {"output": tensors["[0]"] + tensors["[1]"]}}
        return {module: {"output": _main(module, tensors)}}
    if module.endswith(".qkv_proj"):
        sizes, starts = _qkv_sizes(shape)
        return _split(module, _main(module, tensors), ["q_proj", "k_proj", "v_proj"], sizes, starts, shape.tp_size)
    if module.endswith(".gate_up_proj"):
        (inter,) = shape.need("intermediate_size")
        if inter % shape.tp_size:
            raise RebuildError(f"intermediate size {inter} does not shard over {shape.tp_size} tensor-parallel ranks")
        half = inter // shape.tp_size
        return _split(
            module,
            _main(module, tensors),
            ["gate_proj", "up_proj"],
            [half, half],
            [shape.tp_rank * half] * 2,
            shape.tp_size,
        )
    return {module: {"output": _main(module, tensors)}}


FAMILIES = FamilyRegistry()
LLAMA = FAMILIES.register(Family("llama", ("llama",), rebuild_llama))


def register_family(family: Family, replace: bool = False) -> Family:
    """Register ``family`` with :data:`FAMILIES` (the registry ``compare`` reads), for the engine it
    names (``Family.engine``, default ``"vllm"``: a call written before families were keyed by engine
    registers a vLLM family, as it did)."""
    return FAMILIES.register(family, replace=replace)
