"""The shape facts an engine's fused projections are split by (``ModelShape``), read from a
transformers config (``graphpass reference``, the vLLM plugin's worker) and written into each
step's meta (``model``); :mod:`graphpass.capturing.engine_families` splits with them. Shared by the
capture feature and the serving integrations, so it lives at the top level."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .errors import GraphpassError


class RebuildError(GraphpassError, ValueError):
    """One module's tensors cannot be rebuilt (a key missing, a shape that does not split): a FAIL row."""


@dataclass(frozen=True)
class ModelShape:
    """What splitting fused projections needs, per tensor-parallel rank (the engine's meta ``model``).
    ``tp_rank`` is not in the meta (each rank's meta says its own ``tp_rank``): ``compare`` sets it
    to the rank whose tensors a family's ``rebuild`` is given."""

    model_type: str
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    tp_size: int = 1
    tp_rank: int = 0

    @classmethod
    def from_meta(cls, doc: Any) -> "ModelShape | None":
        if not isinstance(doc, Mapping) or not isinstance(doc.get("model_type"), str):
            return None
        ints = {k: doc.get(k) for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")}
        ints = {k: v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None for k, v in ints.items()}
        tp = doc.get("tp_size", 1)
        return cls(doc["model_type"], **ints, tp_size=tp if isinstance(tp, int) and tp > 0 else 1)

    @classmethod
    def from_config(cls, config: Any, tp_size: int = 1) -> "ModelShape":
        """From a transformers config (``model.config``, vLLM's ``hf_config``)."""
        heads = getattr(config, "num_attention_heads", None)
        head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
        return cls(
            str(getattr(config, "model_type", "")),
            heads,
            getattr(config, "num_key_value_heads", None) or heads,
            head_dim,
            getattr(config, "intermediate_size", None),
            tp_size,
        )

    def to_meta(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "tp_rank"}

    def need(self, *names: str) -> list[int]:
        values = [getattr(self, n) for n in names]
        if any(v is None for v in values):
            raise RebuildError(
                f"the engine's meta 'model' lacks {', '.join(n for n, v in zip(names, values) if v is None)}"
            )
        return values
