"""Library functions that are causal along the sequence dim as a whole: the chunked scans of
Mamba-2-style state-space layers and of gated-delta-rule linear attention, and Mamba (v1)'s selective scan.

Used by :mod:`graphpass.static_shapes.padding_safety` (which inserts nothing itself): nodes traced
inside one of these functions are not checked op by op (their zero-padding to a multiple of the chunk,
the within-chunk triangular masks, the sums over a chunk's positions and the scan over chunks are not
row-wise one by one) but as a whole, when the padding sits at the end of the padded dim (``causal_ok``).

Why such a function is safe: every output row ``i`` along the sequence dim (dim 1; the last dim for ``mamba_selective_scan``) depends only on
input rows ``<= i``. Bucketing appends padding rows ``L .. B - 1`` after the real rows ``0 .. L - 1``,
so a real output row never reads a padding row, and the padded output rows are sliced off. The proof of each function (docs/static-shapes.md, "Chunked
scans") holds for its code as written, so a function is trusted only when its source, read from the file
the stack trace names, together with the module-level helpers it calls (``segment_sum``, ...), has the
digest recorded here (decorators and docstrings left out): an edited copy
is checked op by op again, and so refused. The proof is about the code at each size, while the graph is
its trace at the traced length: ``check_padding_safety(..., trusted=)`` reports the trusted functions, and
``plan_static_shapes`` then marks the buckets at which one of Dynamo's guards on the length fails (the chunk
count a loop was unrolled for): calls landing there run unpadded.

What the whole-function rule still checks, at the function's edges (a node inside it that reads or feeds a
node outside it):

* every tensor read from outside with a padded dim has exactly one, the function's sequence dim, of size
  the padded length itself (``s``, not ``s + 1`` or a chunk count): the layout the proof assumes;
* every tensor used outside has the padded dim as the sequence dim and no other: the final recurrent
  state (which sums over every row, padding included) has no padded dim, and is a violation when anything reads it
  (a cache update); the per-row output passes;
* no node inside writes into a tensor from outside (a cache buffer).

A node traced inside one of the function's ``unproven_callees`` (another library's code it may call, whose code
the proof does not cover: mambapy's ``pscan``) is not trusted: it is checked op by op, and its edges with the
trusted nodes are checked as above.

Assumption shared with the other proofs: values are finite (the padding rows' values are finite garbage;
an exact zero weight times a finite value is an exact zero).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

import sympy
import torch

from ..fx_utils import example_of, ran_inside_file, ran_inside_path, size_expr, writes_into

__all__ = [
    "CAUSAL_FUNCTIONS",
    "CausalFunction",
    "benign_guard",
    "causal_function_of",
    "check_causal_edges",
    "is_proven_source",
    "source_digest",
]


@dataclass(frozen=True)
class CausalFunction:
    digest: str  # source_digest of the proven code
    files: tuple[str, ...]  # path suffixes of the files holding an identical copy
    reason: str  # why output row i reads input rows <= i only
    helpers: tuple[str, ...] = ()  # module-level functions of the same file it calls: part of the proven code
    seq_dim: int = 1  # the sequence dim of every sequence argument and result (-1: the last)
    # source lines of the function whose length guard may fail at a bucket without changing the real rows:
    # line text -> why (see benign_guard)
    benign_guards: Mapping[str, str] = field(default_factory=dict)
    # lines of benign_guards that are benign only where the trace took the branch: the guard Dynamo recorded is the
    # condition itself (``pad_size > 0``, a strict ``>``), not its negation (``pad_size <= 0``: the graph traced at a
    # multiple of the chunk, which pads nothing, is not the code's trace where the code pads)
    taken_only: frozenset[str] = frozenset()
    # path suffixes of other libraries' code the function may call whose code the proof does not cover: a node
    # traced inside one of them is not trusted (it is checked op by op)
    unproven_callees: tuple[str, ...] = ()


_MAMBA2 = ("bamba", "falcon_h1", "granitemoehybrid", "mamba2", "nemotron_h", "zamba2")
_KDA = ("bailing_hybrid", "glm5_next", "kimi_linear")
_MAMBA1 = ("falcon_mamba", "jamba", "mamba", "zamba")
_DELTA = ("lara_mini", "olmo_hybrid", "qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen4_exp")

_NO_PAD = (
    "traced with pad_size > 0, the graph pads by pad_size and cuts output[:, :sequence_length]; at a bucket "
    "where pad_size is 0 both are the identity, which is what the code computes there"
)
_UNROLLED = (
    "the loop over chunks is unrolled for the chunk count of the real length (Dynamo checks it per call); "
    "a bucket is at least that long, so every chunk holding a real row is processed, and the chunks past "
    "them hold padding rows only (their outputs stay zero and are sliced off)"
)

#: function name -> the proven code.
CAUSAL_FUNCTIONS: Mapping[str, CausalFunction] = MappingProxyType(
    {
        "mamba2_chunk_scan": CausalFunction(
            "716d32c389cc9046",
            tuple(f"transformers/models/{m}/modeling_{m}.py" for m in _MAMBA2),
            "Mamba-2 SSD chunked scan: chunks start at multiples of chunk_size from row 0 with or without padding; "
            "within a chunk, output row l reads source rows s <= l only (exp(segment_sum) is exp(-inf) = 0 above the "
            "diagonal, and segment_sum's cumsum reads rows <= l); a chunk's state (a sum over all its rows) and the "
            "last row's cumulative decay feed only the start states of later chunks (the inter-chunk decay is again "
            "exp(-inf) = 0 above the diagonal); the D residual is row-wise",
            helpers=("pad_tensor_by_size", "reshape_into_chunks", "segment_sum"),
            benign_guards={"if pad_size > 0:": _NO_PAD},
            taken_only=frozenset({"if pad_size > 0:"}),
        ),
        "torch_chunk_gated_delta_rule": CausalFunction(
            "e8aa42c00b9d9dbe",
            tuple(f"transformers/models/{m}/modeling_{m}.py" for m in _DELTA),
            "gated delta rule, chunked: chunks start at multiples of chunk_size from row 0; within a chunk the "
            "pairwise decays are exp(-inf) = 0 above the diagonal, so the UT system and the intra-chunk attention are "
            "lower triangular, the unit lower-triangular solve (forward substitution) gives row i from rows <= i, "
            "and the chunk's last-row decay and key update feed only the recurrent state read by later chunks",
            helpers=("l2norm",),
            benign_guards={"for i in range(num_chunks):": _UNROLLED},
        ),
        "chunk_kimi_delta_attention": CausalFunction(
            "74cbb14a6f617905",
            tuple(f"transformers/models/{m}/modeling_{m}.py" for m in _KDA),
            "Kimi delta attention, chunked: chunks start at multiples of chunk_size from row 0; the per-channel decays "
            "are a cumsum within the chunk, their pairwise exp is exp(-inf) = 0 above the diagonal; the UT matrix is "
            "masked to its strict lower triangle and the in-place forward substitution builds row i from rows < i; "
            "value = attn @ v_beta and k_cumdecay are lower triangular (plus the identity); the intra-chunk attention "
            "is masked to the lower triangle; the chunk's last-row decay and key update feed only the recurrent state "
            "read by later chunks",
            helpers=("l2norm",),
            benign_guards={"for i in range(total_sequence_length // chunk_size):": _UNROLLED},
        ),
        "mamba_selective_scan": CausalFunction(
            "7741d95862eac581",
            tuple(f"transformers/models/{m}/modeling_{m}.py" for m in _MAMBA1),
            "Mamba (v1) selective scan, sequence last (batch, channels, length): dt's bias and softplus, "
            "discrete_A = exp(A * dt), deltaB_u = dt * B * x and the D residual and silu(z) gate are per row; the "
            "scan h[t] = discrete_A[t] * h[t - 1] + deltaB_u[t] (h[-1] = 0; associative_scan of the affine-map "
            "composition (a_l * a_r, a_r * b_l + b_r) along dim 2, an inclusive scan: row t combines rows 0 .. t in "
            "order; the sequential loop computes the same recurrence) passes state forward only, so all_states[t] "
            "reads rows <= t; the output row t is all_states[t] @ C[t]. The final state (the last row, padding "
            "included) is a violation when read (return_last_state)",
            seq_dim=-1,
            unproven_callees=("mambapy/pscan.py",),
        ),
    }
)


@functools.lru_cache(maxsize=64)
def _digest_at(path: str, functions: tuple[str, ...], mtime_ns: int) -> str | None:
    del mtime_ns  # part of the cache key: an edited file is read again
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in functions:
            node.decorator_list = []
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                node.body = node.body[1:]
            found[node.name] = ast.unparse(node)
    if set(found) != set(functions):
        return None
    return hashlib.sha256("\n\n".join(found[f] for f in functions).encode()).hexdigest()[:16]


def source_digest(path: str, function: str, helpers: tuple[str, ...] = ()) -> str | None:
    """A digest of top-level ``function``'s code in ``path`` and of the helpers it calls (decorators and
    docstrings left out), or None when one is missing."""
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError:
        return None
    return _digest_at(path, (function, *helpers), mtime)


def is_proven_source(path: str, function: str) -> bool:
    """Whether top-level ``function`` of the file at ``path`` is the proven code of ``CAUSAL_FUNCTIONS[function]``:
    the path ends like one of its files and the source (with its helpers) has the recorded digest."""
    fn = CAUSAL_FUNCTIONS.get(function)
    if fn is None:
        return False
    posix = path.replace("\\", "/")
    if not any(posix == suffix or posix.endswith("/" + suffix) for suffix in fn.files):
        return False
    return source_digest(path, function, fn.helpers) == fn.digest


def causal_function_of(node: torch.fx.Node) -> str | None:
    """The proven causal function ``node`` was traced inside (its name), or None."""
    for name, fn in CAUSAL_FUNCTIONS.items():
        for suffix in fn.files:
            path = ran_inside_file(node, suffix, name)
            if path is not None and is_proven_source(path, name):
                if any(ran_inside_path(node, callee) for callee in fn.unproven_callees):
                    return None
                return name
    return None


def benign_guard(where: str, functions: Iterable[str], expr: Any = None) -> str | None:
    """Why a Dynamo guard on the length may fail at a bucket without changing any real row, when its source
    location (``guard.sloc``: ``"<code>  # <file>:<line> in <function>"``) is one of ``functions``' listed
    lines (and, for a line of ``taken_only``, the guard ``expr`` is the condition taken: a strict ``>``); None
    otherwise."""
    code, _, frame = where.partition("  # ")
    code = code.strip()
    for name in functions:
        fn = CAUSAL_FUNCTIONS.get(name)
        if fn is None or not frame.endswith(f" in {name}") or code not in fn.benign_guards:
            continue
        if code in fn.taken_only and not isinstance(expr, sympy.StrictGreaterThan):
            return None
        return fn.benign_guards[code]
    return None


def _layout_ok(
    value: Any, seq_dim: int, padded: Callable[[Any], tuple[int, ...]], is_length: Callable[[Any], bool]
) -> bool:
    t = example_of(value)
    dims = padded(t)
    if not dims:
        return True
    d = seq_dim % t.dim()
    return dims == (d,) and is_length(t.shape[d])


def check_causal_edges(
    node: torch.fx.Node, function: str, padded: Callable[[Any], tuple[int, ...]], is_length: Callable[[Any], bool]
) -> tuple[int | None, str] | None:
    """The violation at ``node``'s edges out of ``function`` (see the module docstring), or None.
    ``padded(t)``: the padded dims of a tensor; ``is_length(size)``: the size is the padded length itself."""

    def inside(n: torch.fx.Node) -> bool:
        return causal_function_of(n) == function

    seq = CAUSAL_FUNCTIONS[function].seq_dim
    where = "the last dim" if seq == -1 else f"dim {seq}"

    for a in node.all_input_nodes:
        if inside(a):
            continue
        if writes_into(node, a):
            return None, f"{function} writes into a tensor from outside it ({a.name}): its rows are not proven"
        t = example_of(a)
        if isinstance(t, torch.Tensor) and not _layout_ok(t, seq, padded, is_length):
            return None, (
                f"{function} reads {a.name} (shape {tuple(str(size_expr(s)) for s in t.shape)}) whose "
                f"padded dim is not {where} of the padded length: the layout the causal proof assumes"
            )
    t = example_of(node)
    if not isinstance(t, torch.Tensor) or all(inside(u) for u in node.users):
        return None
    if not padded(t):
        return None, (
            f"{function}'s result {node.name} has no padded dim but is used outside it: a final "
            "recurrent state sums over every row, the padding included"
        )
    if not _layout_ok(t, seq, padded, is_length):
        d = seq % t.dim()
        if padded(t) == (d,):  # the right dim, another size: the trace's row count is not the padded length
            return None, (
                f"{function}'s result {node.name} is used outside it with {where} of size "
                f"{size_expr(t.shape[d])}, not the padded length: the graph is not the code's trace at "
                "another length"
            )
        return None, f"{function}'s result {node.name} is used outside it with the padded dim not {where}"
    return None
