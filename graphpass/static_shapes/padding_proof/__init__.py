"""The padding proof of static-shape bucketing: may a graph be padded along a dim.

Bucketing pads a varying input dim (the sequence length ``L`` of ``input_ids``, say) up to a bucket
size, runs the static graph compiled for that bucket and slices the outputs back. That is exact
only if **every output row along the padded dim depends only on the same input row**, with the
padding rows staying at the end of the dim. :func:`prove_padding` proves this for a
Dynamo-level graph with dynamic shapes, or names the nodes that break it.

The rule works on shapes alone. Every node's ``meta["example_value"]`` is a FakeTensor whose sizes
are SymInts; a dim *is padded* when its size expression mentions one of the given symbols
(``L``, ``2*L``, ``B*L``, ``L - 1``). For each op node the analysis looks at the padded dims of its
tensor inputs and output and at its arguments, and decides whether the op mixes rows along a
padded dim:

* **safe** -- pointwise ops (:data:`.tables.POINTWISE`), dim-wise layout ops (:data:`.tables.LAYOUT`), reshapes that
  keep rows apart (:data:`.tables.RESHAPES`, see :func:`.op_checks._reshape_keeps_rows`), indexing that counts from
  the start of the padded dim, factories (:data:`FACTORIES`: ``arange(L)`` gives row ``i`` the
  value ``i`` with or without padding), size queries (:data:`META`), ops along / contracting /
  normalising over dims that are not padded, ``cat`` whose padded piece is the last one, ``stack``,
  causal ops (when ``causal_ok``: row ``i`` only reads rows ``<= i`` and the padding sits at the
  end, so real rows never read padding): ``scaled_dot_product_attention`` with ``is_causal``, the
  prefix scans of :data:`CAUSAL_SCANS` (``cumsum``: transformers' position and packed-sequence
  masks) and ``diff`` without ``append``, SymInt arithmetic (no tensor in or out), and graphpass's own
  ``torch.ops.graphpass.*`` markers.
* **a violation** -- any op of :data:`ALONG_DIM` (reductions, scans, sorts, flips, rolls, diffs,
  splits, gathers) along a padded dim, or over all dims when a dim is padded; a matmul-family op
  (:data:`MATMULS`) contracting over a padded dim; a normalisation (:data:`NORMS`) over a padded
  dim; non-causal attention over a padded key/value sequence; ``cat`` / ``repeat`` / ``pad`` that
  put something after the padding; indexing from the end of a padded dim or with a tensor along
  it; a reshape that scrambles rows; the padded length used as a *value* (``x * x.size(1)``); and
  every op not in these tables whose input or output has a padded dim or whose arguments mention
  a symbol -- conservative by design. Custom ops (OpOverloads outside ``aten``/``prims``) and
  higher-order ops count as unknown.

Op names are matched by their bare name, whichever way Dynamo records them: a callable
(``torch.softmax``, ``torch.nn.functional.softmax``, ``torch._C._nn.linear``, ``operator.matmul``),
a ``call_method`` name (``"softmax"``), or an aten OpOverload (``aten.sum.dim_IntList``); for
OpOverloads arguments are read by their schema names, so aten graphs work for the ops listed too.

How the package is laid out (what a contributor extends):

* :mod:`.facts` -- the facts a node's values are known to hold whatever the padding (``Positions``, ``Causal``,
  ``NegMask``, ...), frozen dataclasses with their dim fields declared once (``DIMS``);
* :mod:`.tables` -- the op tables (names only) and the library functions proven row-wise as a whole;
* :mod:`.registry` -- the two rule tables, keyed by op name: op rules (:func:`op_rule`: one check per name, an
  unknown name is refused, conservatively) and fact rules (:func:`fact_rule`: tried in order, first fact wins),
  and the :class:`ProofContext` the rules read;
* :mod:`.op_checks` -- the op rules; :mod:`.provenance` -- the fact rules and :func:`index_provenance`;
* :mod:`.patterns` -- whole-pattern rules (:class:`PatternRule`): graphpass's ops, row-wise library functions, the
  causal functions trusted by source digest, rows written into a key/value cache; extra ones (a top-k indexer,
  :mod:`..topk_mask`) are passed to :func:`prove_padding`;
* :mod:`.result` -- :class:`PaddingProof` (violations, per-call :class:`CallCheck` s, per-bucket checks and their
  typed :class:`InvalidBucket` reasons, which rule accepted each node) and :mod:`.conditions`, the checks themselves;
* :mod:`.prove` -- :func:`prove_padding` and the older :func:`check_padding_safety` over it.
"""

from __future__ import annotations

from .facts import (
    AllTrue,
    Causal,
    Const,
    Diag,
    KeysOnly,
    MaskedAbove,
    NegKeys,
    NegMask,
    OnePad,
    PadCount,
    Positions,
    ZeroAbove,
    ZeroKeys,
    ZeroPad,
    ZeroPadIf,
)
from .conditions import CausalTablesCheck, GuardBuckets, OnesCheck, TableBuckets
from .nodes import padded_dims
from .op_checks import UNKNOWN_OP
from .patterns import PATTERN_RULES, PatternProof, PatternRule
from .prove import check_padding_safety, prove_padding
from .provenance import index_provenance
from .registry import FACT_RULES, OP_RULES, FactEnv, FactRule, OpRule, ProofContext, fact_rule, op_rule, remove_op_rule
from .result import BucketCheck, CallCheck, GuardFails, InvalidBucket, NotProven, PaddingProof, PaddingViolation
from .tables import ROW_WISE_FUNCTIONS

__all__ = [
    "AllTrue",
    "BucketCheck",
    "CallCheck",
    "Causal",
    "CausalTablesCheck",
    "Const",
    "Diag",
    "FACT_RULES",
    "FactEnv",
    "FactRule",
    "GuardBuckets",
    "GuardFails",
    "InvalidBucket",
    "KeysOnly",
    "MaskedAbove",
    "NegKeys",
    "NegMask",
    "NotProven",
    "OP_RULES",
    "OnePad",
    "OnesCheck",
    "OpRule",
    "PATTERN_RULES",
    "PadCount",
    "PaddingProof",
    "PaddingViolation",
    "PatternProof",
    "PatternRule",
    "Positions",
    "ProofContext",
    "ROW_WISE_FUNCTIONS",
    "TableBuckets",
    "UNKNOWN_OP",
    "ZeroAbove",
    "ZeroKeys",
    "ZeroPad",
    "ZeroPadIf",
    "check_padding_safety",
    "fact_rule",
    "index_provenance",
    "op_rule",
    "padded_dims",
    "prove_padding",
    "remove_op_rule",
]
