"""A differential fuzzer for the padding-safety proof (issue 33, item 2).

Static-shape bucketing pads a varying dim up to a bucket only where :func:`~.padding_proof.check_padding_safety`
proves that every real output row reads real input rows only. A proof rule that is unsound shows up as a bucketed
call whose real rows differ from eager's. This module generates random small programs from an op vocabulary that
touches every rule of the proof, compiles each with graphpass's bucketing and compares every padded call with eager.

**Programs.** A :class:`Program` is a list of :class:`Step` s (an op family, ``kind``, and its parameters). The
interpreter (:func:`program_source`) turns it, deterministically, into the Python source of an ``nn.Module``
(weights drawn from the program's seed), which :func:`build_module` executes: the source printed for a failing
program is exactly what ran. Every step maps the stream ``h`` of shape ``[B, S, D]`` (``S = L + off``, ``L`` the
padded length of the input ``x: [B, L, H]`` float32) to another such stream, or appends a side output; the
interpreter tracks ``off`` and ``D`` and adapts a step to the stream it gets (a step that cannot apply becomes a
comment), so any sub-list of steps is a valid program: that is what lets :func:`shrink` drop steps. Inputs: ``x``
always; ``ids`` (int64 ``[B, L]``) and ``attention_mask`` (int64 or bool ``[B, L]``) when a step reads them.

Op families (:data:`FAMILIES`), each with variants the proof must accept and variants it must refuse: attention
(SDPA ``is_causal``; boolean masks from ``arange`` compares ``kv + ok <= q + oq`` / ``<``, windows, ANDed with the
attention mask; additive masks ``where(mask, 0, finfo.min)`` into SDPA or a hand-written softmax/matmul attention;
keys-only masks and the legacy ``(1 - m) * finfo.min``; an OR with an all-false constant; a learned sink logit
appended after the keys and dropped after the softmax; keys that are a shifted slice ``h[:, 1:]`` or a shift padded
back, queries shorter than keys, static learned queries over padded keys); ``conv1d`` with random kernel, padding,
dilation and a slice of its output (``[..., :S]``, ``[..., 2:]``, ``[..., 1:-1]`` or none, a pointwise op first or
not); reshapes that merge the padded dim with the batch or hidden dim and split it back in the same or another order,
``flatten``/``unflatten``, permutes, ``repeat`` viewed back; integer positions ``arange(S).to(int8/int16/int32/uint8)``
used as an index, compared for a mask (as a matmul weight or in attention) or added as a bias; gathers and index ops
(``index_select``, ``gather``, ``take_along_dim``, ``x[:, idx]`` with identity / shifted / reversed / halved indices,
``x[:, -1]``, ``x[:, :-1]``, ``narrow``; static tables looked up by position, one shorter than the largest
bucket); scans (``cumsum``, ``cumprod``, ``cummax``, ``logcumsumexp``, ``diff``
with ``prepend`` / ``append``); ``cat`` and ``F.pad`` before and after the padded rows and along other dims;
reductions and normalisations (``sum``, ``mean``, ``amax``, ``max``, ``softmax``, ``log_softmax``, ``logsumexp``,
``layer_norm``, ``instance_norm``, RMS norm) over the padded and the hidden dim; sorts, flips, rolls, top-k;
pointwise ops; ``linear``, ``matmul``, ``einsum``, and products contracting the padded dim; the length used as a
value; reads of ``ids`` and ``attention_mask`` (embeddings, counts, ``cumsum == 0``).

**The property** (:func:`run_program`, the *full path*: what a user runs). The module is compiled with
``torch.compile(module, backend=graphpass.backend(then=<recording delegate>, static_shapes={"dims": {every input:
1}, "buckets": ..., "pad_value": ...}))`` and called at several lengths (the inputs' length dims marked
``maybe_mark_dynamic`` on the first call, so Dynamo traces one dynamic graph and graphpass plans it, with no
exact-size first graph; a program whose code pins the length gets static graphs and counts as refused), either with
buckets ``[16, 32, 64]`` at lengths 7, 15, 33, 63 or with ``[64, 128, 256]`` at 9, 70, 131, 200 (lengths past 127,
where ``int8`` positions wrap; the 256 bucket's padding rows reach 255, the last ``uint8`` value; programs with
narrow integer positions draw these buckets 70 % of the time, the others 20 %). Whether graphpass padded a call is read from the delegate: its compiled
function records the shapes it runs at, so a call that ran at the bucket's length instead of the call's was
padded. That observable needs nothing of graphpass's internals. Where a call was padded, every output must equal
eager's at the real length: bitwise (``torch.equal``, NaN equal to NaN) when the program only moves data, else
within ``rtol=1e-5`` and ``atol=1e-5 * (1 + max |eager|)``: padding changes the shapes of matmuls, convolutions and
attention kernels, so BLAS may block a sum differently (fp32 rounding of the same rows, never another row's value);
a padding row leaking into a real row moves it by the scale of the values, far beyond that. The padding fill is
varied: ``x`` is padded with a non-zero value in most programs (so a rule that silently relies on zero padding is
caught; with the default 0 in the rest), and ``ids`` / ``attention_mask`` with 0 or another value. The proof may
rely on the zero padding of an input only when the config pads it with 0 (the planner passes exactly those inputs as
``zero_padded``), so every fill here is one the proof is told about: varying it is never a false alarm. The mask
holds 1 at every real position except in one call per program (leading zeros), which exercises the per-call checks.
Fills are moderate (``1.5``, ``-2``, ``0.5``, ``3``), as the proof assumes finite values.

Results (:class:`Result.category`): ``refused`` (no call padded: fine), ``exact`` (padded, equal), ``WRONG``
(padded, different: a bug of the proof), ``error`` (a crash in compiling or calling; a bug unless it is a
:class:`~graphpass.errors.GraphpassError`, counted apart as ``graphpass_error``), ``invalid`` (the program fails
eagerly: a bug of this generator, never counted against graphpass) and ``graph_break`` (Dynamo split the program;
none expected).

**Shrinking** (:func:`shrink`): a failing program is shrunk greedily (drop each step, then simplify each step's
parameters, then keep only the lengths that fail) while it still fails the same way, and printed as Python source
(:func:`format_failure`).

**Cost.** One Dynamo trace (fake tensors with symbolic sizes) per program dominates: about 0.5 to 0.8 s per program
on one core of the shared 2-core machine (the test and the bench run with one intra-op thread: with torch's default
pool it was 0.98 s against 0.59 s on the same 30 programs), plus a
delegate compile per bucket (a copy of the graph) and the eager and compiled calls. Profiled over 40 programs: Dynamo
~87 % of the time, graphpass's passes (the proof included) ~6 %, the dispatcher (bucket compiles, padding, slicing)
~4 %. ``torch._dynamo.reset()`` runs before every program (Dynamo's caches otherwise grow with every new code
object); Dynamo's fake-tensor memo cache is off (its entries are never reused by another program). There is no
faster honest harness: one that traced once and ran the proof itself would still pay the same Dynamo trace (what
the proof reads), saving at most the ~10 % of graphpass's passes and bucket compiles, while no longer testing the
planner's arguments to the proof, the dispatcher's padding and slicing, or the per-call checks. So there is one
harness, the full path, for every program.
"""

from __future__ import annotations

import linecache
import logging
import math
import random
import time
import traceback
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Sequence

import torch

log = logging.getLogger("graphpass.static_shapes.padding_fuzz")

__all__ = ["Step", "Program", "Result", "FAMILIES", "generate", "program_source", "build_module", "run_program",
           "shrink", "format_failure", "fuzz", "summarize"]

B = 2  # batch: distinct from every length and hidden size
H = 8  # hidden size of x
V = 11  # vocabulary of ids
MIN_S = 3  # the stream keeps at least this many rows at the shortest call length
MAX_OFF = 4
MAX_D = 16

#: (buckets, lengths): the first length is the traced one (marked dynamic).
SMALL = ((16, 32, 64), (7, 15, 33, 63))
LARGE = ((64, 128, 256), (9, 70, 131, 200))
MIN_LEN = min(SMALL[1][0], LARGE[1][0])

X_FILLS = (1.5, -2.0, 0.5, 3.0)
CATEGORIES = ("refused", "exact", "WRONG", "error", "graphpass_error", "invalid", "graph_break")


@dataclass(frozen=True)
class Step:
    """One op-step of a program: its family (``kind``) and parameters (sorted ``(name, value)`` pairs)."""

    kind: str
    params: tuple[tuple[str, Any], ...] = ()

    @staticmethod
    def of(kind: str, **params: Any) -> "Step":
        return Step(kind, tuple(sorted(params.items())))

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.params).get(name, default)

    def with_(self, **changes: Any) -> "Step":
        p = dict(self.params)
        p.update(changes)
        return Step.of(self.kind, **p)

    def __str__(self) -> str:
        return f"{self.kind}(" + ", ".join(f"{k}={v!r}" for k, v in self.params) + ")"


@dataclass(frozen=True)
class Program:
    """A program: its steps, the seed of its weights and inputs, the bucket set and the padding fills."""

    steps: tuple[Step, ...]
    seed: int
    large: bool = False  # buckets [64, 128, 256] (lengths past 127 and 255) instead of [16, 32, 64]
    x_fill: float = 1.5
    ids_fill: int = 0
    mask_fill: int = 0
    mask_bool: bool = False
    lengths: tuple[int, ...] | None = None  # None: the bucket set's lengths

    @property
    def buckets(self) -> tuple[int, ...]:
        return (LARGE if self.large else SMALL)[0]

    @property
    def call_lengths(self) -> tuple[int, ...]:
        return self.lengths if self.lengths is not None else (LARGE if self.large else SMALL)[1]

    def __str__(self) -> str:
        return (f"Program(seed={self.seed}, buckets={list(self.buckets)}, lengths={list(self.call_lengths)}, "
                f"x_fill={self.x_fill}, ids_fill={self.ids_fill}, mask_fill={self.mask_fill}, "
                f"mask_bool={self.mask_bool}, steps=[{', '.join(map(str, self.steps))}])")


# ----------------------------------------------------------------------------------------------------------------
# The vocabulary: per family, the variants and how each is drawn
# ----------------------------------------------------------------------------------------------------------------

INT_DTYPES = ("int8", "int16", "int32", "uint8", "int64")

_VARIANTS: dict[str, tuple[str, ...]] = {
    "pointwise": ("relu", "tanh", "sigmoid", "gelu", "silu", "affine", "abs", "square", "leaky", "masked_fill",
                  "exp_clamp", "where"),
    "linear": ("linear", "matmul", "einsum", "bmm", "linear_nobias"),
    "reduce": ("mean_h", "softmax_h", "layer_norm", "rms_norm", "amax_h", "logsumexp_h", "log_softmax_h", "var_h",
               "sum_s", "mean_s", "softmax_s", "amax_s", "max_s", "log_softmax_s", "instance_norm", "sum_all",
               "norm_s", "logsumexp_s", "masked_mean"),
    "scan": ("cumsum", "cumprod", "cummax", "logcumsumexp", "diff", "diff_prepend", "diff_append", "cumsum_h",
             "flip_cumsum"),
    "slice": ("drop_first", "drop_last", "drop2", "narrow_prefix", "narrow_shift", "neg_n", "last_bcast",
              "first_bcast", "keep_prefix", "last_minus_one", "neg_len_x", "split_len", "split_len_minus",
              "split_tail_read", "split_halves"),
    "repad": ("pad_left", "pad_right", "pad_right_value", "cat_front", "cat_back", "cat_self_back", "cat_hidden",
              "pad_hidden", "shift_right", "shift_left", "stack_mean"),
    "index": ("index_select_id", "index_select_rev", "gather_id", "take_along_id", "adv_id", "adv_prev", "adv_next",
              "adv_minus1", "adv_half", "narrow_id", "ids_gather", "index_neg_last", "table_emb", "table_index",
              "table_short"),
    "intpos": ("index", "index_shift", "bias", "cmp_matmul", "cmp_cummean"),
    "attn": ("sdpa",),
    "conv": ("conv1d",),
    "reshape": ("heads_roundtrip", "merge_batch", "merge_batch_wrong", "merge_hidden", "merge_hidden_wrong",
                "flatten_unflatten", "flatten_unflatten_wrong", "permute_roundtrip", "repeat_view", "repeat_view_wrong",
                "expand_merge_wrong"),
    "mix": ("gram", "einsum_seq", "outer_seq"),
    "ids": ("emb", "ids_mask", "ids_cumsum", "ids_count"),
    "mask": ("mul", "count", "left_count", "eq0_count", "cumsum_pos", "any_pad", "left_count_int8",
             "left_count_uint8"),
    "sortlike": ("sort_s", "sort_h", "topk_h", "topk_s", "flip_s", "flip_h", "roll_s", "roll_h", "argmax_s_side"),
    "value": ("mul_len", "arange_frac", "arange_bias", "full_len"),
    "side": ("side_h", "side_last", "side_first", "side_pool", "side_x_last", "side_cumsum"),
}

#: Op families (the per-family acceptance rows of the bench).
FAMILIES: tuple[str, ...] = tuple(_VARIANTS)

_WEIGHTS = {"attn": 5, "conv": 4, "reshape": 3, "intpos": 3, "index": 3, "scan": 3, "repad": 3, "reduce": 3,
            "pointwise": 2, "linear": 2, "slice": 2, "mix": 1, "ids": 1, "mask": 1.5, "sortlike": 1, "value": 1,
            "side": 1}

#: Per family, the variants this generator expects the proof to accept (a guess, used only to draw them more often:
#: a program is padded only when every step is accepted, and only padded programs test the proof's soundness).
_LIKELY_SAFE: dict[str, tuple[str, ...]] = {
    "pointwise": _VARIANTS["pointwise"],
    "linear": _VARIANTS["linear"],
    "reduce": ("mean_h", "softmax_h", "layer_norm", "rms_norm", "amax_h", "logsumexp_h", "log_softmax_h", "var_h",
               "masked_mean"),
    "scan": ("cumsum", "cumprod", "cummax", "logcumsumexp", "diff", "diff_prepend", "cumsum_h"),
    "slice": ("drop_first", "drop_last", "drop2", "narrow_prefix", "narrow_shift", "neg_n", "first_bcast",
              "keep_prefix", "split_len", "split_len_minus"),
    "repad": ("pad_left", "cat_front", "cat_hidden", "pad_hidden", "shift_right", "stack_mean"),
    "index": ("index_select_id", "gather_id", "adv_id", "narrow_id", "adv_prev", "table_emb", "table_index",
              "table_short"),
    "intpos": ("index", "bias", "cmp_matmul", "cmp_cummean"),
    "attn": ("sdpa",),
    "conv": ("conv1d",),
    "reshape": ("heads_roundtrip", "merge_batch", "merge_hidden", "flatten_unflatten", "permute_roundtrip",
                "repeat_view"),
    "mix": _VARIANTS["mix"],
    "ids": ("emb", "ids_mask", "ids_cumsum"),
    "mask": ("mul", "count", "left_count", "cumsum_pos"),
    "sortlike": ("sort_h", "topk_h", "flip_h", "roll_h"),
    "value": ("arange_bias",),
    "side": ("side_h", "side_first"),
}

ATTN_SOURCES = ("self", "self", "self", "shift_k1", "k_drop_last", "k_shift_right", "shift_q1", "static_q")
ATTN_MASKS = ("causal", "causal", "bool", "bool", "add_sdpa", "manual_add", "manual_bool", "none", "keys_am",
              "legacy_am")
SAFE_PROBABILITY = 0.7  # a step is drawn from the likely-safe variants this often


def _draw_step(rng: random.Random, kind: str) -> Step:
    safe = rng.random() < SAFE_PROBABILITY
    variant = rng.choice((_LIKELY_SAFE if safe else _VARIANTS)[kind])
    if kind == "attn":
        if safe:
            return Step.of("attn", src=rng.choice(("self", "self", "self", "k_shift_right")),
                           mask=rng.choice(ATTN_MASKS[:7] + ("keys_am", "legacy_am")), oq=0,
                           ok=rng.choice((0, 0, 1)), cmp="le", window=rng.choice((None, None, 3)),
                           and_am=rng.random() < 0.25, proj=rng.random() < 0.5,
                           int_dt=rng.choice((None, None, None) + INT_DTYPES[:4]), q_len=rng.choice((4, 8)),
                           sink=rng.random() < 0.2, or_false=rng.random() < 0.2)
        return Step.of("attn", src=rng.choice(ATTN_SOURCES), mask=rng.choice(ATTN_MASKS),
                       oq=rng.choice((0, 0, 0, 1, -1)), ok=rng.choice((0, 0, 0, 1, -1)),
                       cmp=rng.choice(("le", "le", "lt")), window=rng.choice((None, None, None, 3)),
                       and_am=rng.random() < 0.25, proj=rng.random() < 0.5,
                       int_dt=rng.choice((None, None, None) + INT_DTYPES[:4]), q_len=rng.choice((4, 8)),
                       sink=rng.random() < 0.2, or_false=rng.random() < 0.2)
    if kind == "conv":
        k = rng.choice((1, 2, 3, 4))
        d = rng.choice((1, 1, 2))
        reach = (k - 1) * d
        if safe:
            p, cut = rng.choice(((reach, "prefix"), (reach + 1, "prefix"), (0, "none"), (0, "left2")))
        else:
            p = rng.choice(sorted({0, reach // 2, reach, reach + 1}))
            cut = rng.choice(("prefix", "prefix", "none", "left2", "centre"))
        return Step.of("conv", k=k, dilation=d, padding=p, cut=cut, act=rng.random() < 0.3)
    if kind == "intpos":
        return Step.of("intpos", use=variant, dt=rng.choice(INT_DTYPES), shift=rng.choice((0, 0, 1, -1)))
    return Step.of(kind, v=variant)


def generate(seed: int, max_steps: int = 6) -> Program:
    """The program of ``seed`` (deterministic)."""
    rng = random.Random(seed)
    n = rng.choice((1, 2, 2, 3, 3, 4, 5, max_steps))
    kinds = list(_WEIGHTS)
    weights = [_WEIGHTS[k] for k in kinds]
    steps = tuple(_draw_step(rng, rng.choices(kinds, weights)[0]) for _ in range(n))
    uses_int = any(s.kind == "intpos" or (s.kind == "attn" and s.get("int_dt")) for s in steps)
    large = rng.random() < (0.7 if uses_int else 0.2)
    x_fill = 0.0 if rng.random() < 0.2 else rng.choice(X_FILLS)
    return Program(steps=steps, seed=seed, large=large, x_fill=x_fill, ids_fill=rng.choice((0, 0, 3)),
                   mask_fill=rng.choice((0, 0, 1)), mask_bool=rng.random() < 0.25)


# ----------------------------------------------------------------------------------------------------------------
# The interpreter: steps -> Python source of an nn.Module
# ----------------------------------------------------------------------------------------------------------------


def prog_lengths(st: "_State") -> tuple[int, ...]:
    return st.lengths


class _State:
    def __init__(self, buckets: tuple[int, ...] = SMALL[0], lengths: tuple[int, ...] = SMALL[1]) -> None:
        self.buckets = buckets
        self.lengths = lengths
        self.off = 0  # S = L + off
        self.d = H
        self.init: list[str] = []
        self.fwd: list[str] = []
        self.uses_ids = False
        self.uses_mask = False
        self.inexact = False  # the program computes with rounding that depends on shapes (BLAS, kernels)
        self.k = 0  # parameter counter

    def param(self, shape: Sequence[int], scale: float | None = None) -> str:
        name = f"p{self.k}"
        self.k += 1
        fan = scale if scale is not None else 1.0 / math.sqrt(shape[-1] if shape else 1)
        self.init.append(f"self.{name} = nn.Parameter(torch.randn({tuple(shape)!r}, generator=g) * {fan:.4g})")
        return f"self.{name}"

    def emit(self, *lines: str) -> None:
        self.fwd.extend(lines)

    def skip(self, why: str) -> None:
        self.fwd.append(f"# skipped: {why}")

    def can_shift(self, delta: int) -> bool:
        new = self.off + delta
        return MIN_LEN + new >= MIN_S and new <= MAX_OFF

    def am_rows(self) -> str | None:
        """The attention mask aligned with the stream's rows (only when ``S == L``)."""
        if self.off != 0:
            return None
        self.uses_mask = True
        return "attention_mask"


def _emit_pointwise(st: _State, s: Step) -> None:
    v = s.get("v")
    expr = {"relu": "torch.relu(h)", "tanh": "torch.tanh(h)", "sigmoid": "torch.sigmoid(h)", "gelu": "F.gelu(h)",
            "silu": "F.silu(h)", "affine": "h * 1.5 - 0.25", "abs": "h.abs()", "square": "h * h",
            "leaky": "F.leaky_relu(h, 0.1)", "masked_fill": "h.masked_fill(h > 1.0, 0.0)",
            "exp_clamp": "torch.exp(h.clamp(max=10.0))", "where": "torch.where(h > 0, h, 0.1 * h)"}[v]
    if v in ("gelu", "silu", "sigmoid", "tanh", "exp_clamp"):
        st.inexact = True
    st.emit(f"h = {expr}")


def _emit_linear(st: _State, s: Step) -> None:
    v = s.get("v")
    st.inexact = True
    dout = 8 if st.d != 8 else 12 if v == "linear" else 8
    if v in ("linear", "linear_nobias"):
        w = st.param((dout, st.d))
        if v == "linear":
            b = st.param((dout,), 0.1)
            st.emit(f"h = F.linear(h, {w}, {b})")
        else:
            st.emit(f"h = F.linear(h, {w})")
    elif v == "matmul":
        w = st.param((st.d, dout))
        st.emit(f"h = h @ {w}")
    elif v == "einsum":
        w = st.param((st.d, dout))
        st.emit(f"h = torch.einsum('bsd,de->bse', h, {w})")
    else:
        w = st.param((1, st.d, dout))
        st.emit(f"h = torch.bmm(h, {w}.expand(h.shape[0], -1, -1))")
    st.d = dout


def _emit_reduce(st: _State, s: Step) -> None:
    v = s.get("v")
    st.inexact = True
    d = st.d
    code = {
        "mean_h": "h = h - h.mean(-1, keepdim=True)",
        "softmax_h": "h = h.softmax(-1)",
        "layer_norm": f"h = F.layer_norm(h, ({d},))",
        "rms_norm": "h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)",
        "amax_h": "h = h - h.amax(-1, keepdim=True)",
        "logsumexp_h": "h = h - torch.logsumexp(h, -1, keepdim=True)",
        "log_softmax_h": "h = torch.log_softmax(h, dim=-1)",
        "var_h": "h = h / (h.var(-1, keepdim=True) + 1.0)",
        "sum_s": "h = h + h.sum(1, keepdim=True)",
        "mean_s": "h = h - h.mean(1, keepdim=True)",
        "softmax_s": "h = h.softmax(1)",
        "amax_s": "h = h - h.amax(1, keepdim=True)",
        "max_s": "h = h - h.max(1, keepdim=True).values",
        "log_softmax_s": "h = torch.log_softmax(h, dim=1)",
        "instance_norm": "h = F.instance_norm(h.transpose(1, 2)).transpose(1, 2)",
        "sum_all": "h = h + h.sum()",
        "norm_s": "h = h / (h.norm(dim=1, keepdim=True) + 1.0)",
        "logsumexp_s": "h = h - torch.logsumexp(h, 1, keepdim=True)",
    }.get(v)
    if v == "masked_mean":
        am = st.am_rows()
        if am is None:
            return st.skip("masked_mean needs the stream aligned with attention_mask")
        st.emit(f"m = {am}[..., None].to(h.dtype)",
                "h = h + (h * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1.0)")
        return
    st.emit(code)


def _emit_scan(st: _State, s: Step) -> None:
    v = s.get("v")
    if v in ("cumprod", "logcumsumexp", "cumsum", "cumsum_h", "flip_cumsum"):
        st.inexact = True
    if v == "cumsum":
        st.emit("h = torch.cumsum(h, dim=1)")
    elif v == "cumprod":
        st.emit("h = torch.cumprod(torch.sigmoid(h) + 0.5, dim=1)")
    elif v == "cummax":
        st.emit("h = torch.cummax(h, dim=1).values")
    elif v == "logcumsumexp":
        st.emit("h = torch.logcumsumexp(h, dim=1)")
    elif v == "cumsum_h":
        st.emit("h = h.cumsum(-1)")
    elif v == "flip_cumsum":
        st.emit("h = h.flip(1).cumsum(1).flip(1)")
    elif v == "diff":
        if not st.can_shift(-1):
            return st.skip("diff would leave too few rows")
        st.emit("h = torch.diff(h, dim=1)")
        st.off -= 1
    elif v == "diff_prepend":
        st.emit("h = torch.diff(h, dim=1, prepend=h[:, :1])")
    elif v == "diff_append":
        st.emit("h = torch.diff(h, dim=1, append=h[:, -1:])")


def _emit_slice(st: _State, s: Step) -> None:
    v = s.get("v")
    shifts = {"drop_first": -1, "drop_last": -1, "drop2": -2, "narrow_prefix": -1, "narrow_shift": -1,
              "keep_prefix": -1, "last_minus_one": 0, "split_len_minus": -1, "split_tail_read": -1}
    delta = shifts.get(v, 0)
    if delta and not st.can_shift(delta):
        return st.skip(f"{v} would leave too few rows")
    code = {
        "drop_first": "h = h[:, 1:]",
        "drop_last": "h = h[:, :-1]",
        "drop2": "h = h[:, 2:]",
        "narrow_prefix": "h = h.narrow(1, 0, h.shape[1] - 1)",
        "narrow_shift": "h = h.narrow(1, 1, h.shape[1] - 1)",
        "keep_prefix": "h = h[:, : h.shape[1] - 1]",
        "neg_n": "h = h[:, -h.shape[1]:]",
        "neg_len_x": "h = h[:, -x.shape[1]:]",
        "last_bcast": "h = h + h[:, -1:]",
        "first_bcast": "h = h + h[:, :1]",
        "last_minus_one": "h = h + h[:, -2:-1]",
        # transformers 5.25's state-space split (the second piece empty, or the last rows, unread / read)
        "split_len": "h, _ = torch.tensor_split(h, [h.shape[1]], dim=1)",
        "split_len_minus": "h, _ = torch.tensor_split(h, [h.shape[1] - 1], dim=1)",
        "split_tail_read": "h, _t = torch.tensor_split(h, [h.shape[1] - 1], dim=1)\nh = h + _t.sum(1, keepdim=True)",
        "split_halves": "_a, _b = torch.tensor_split(h, 2, dim=1)\nh = torch.cat([_b, _a], dim=1)",
    }[v]
    st.emit(*code.split("\n"))
    st.off += delta


def _emit_repad(st: _State, s: Step) -> None:
    v = s.get("v")
    if v in ("cat_hidden", "pad_hidden"):
        if v == "cat_hidden":
            st.emit("h = torch.cat([h, h.flip(-1)], dim=-1)")
            st.d *= 2
        else:
            st.emit("h = F.pad(h, (1, 1))")
            st.d += 2
        if st.d > MAX_D:
            st.emit(f"h = h[..., :{H}]")
            st.d = H
        return
    if v == "stack_mean":
        st.emit("h = torch.stack([h, h * 2.0], dim=2).mean(2)")
        return
    if v in ("shift_right", "shift_left"):
        if not st.can_shift(-1):
            return st.skip(f"{v} would leave too few rows")
        st.emit("h = F.pad(h[:, :-1], (0, 0, 1, 0))" if v == "shift_right" else "h = F.pad(h[:, 1:], (0, 0, 0, 1))")
        return
    delta = 2 if v in ("cat_front", "cat_back") else 1
    if not st.can_shift(delta):
        return st.skip(f"{v} would make the stream too long")
    if v == "pad_left":
        st.emit("h = F.pad(h, (0, 0, 1, 0))")
    elif v == "pad_right":
        st.emit("h = F.pad(h, (0, 0, 0, 1))")
    elif v == "pad_right_value":
        st.emit("h = F.pad(h, (0, 0, 0, 1), value=1.0)")
    elif v in ("cat_front", "cat_back"):
        c = st.param((1, 2, st.d), 1.0)
        pieces = f"{c}.expand(h.shape[0], -1, -1), h" if v == "cat_front" else f"h, {c}.expand(h.shape[0], -1, -1)"
        st.emit(f"h = torch.cat([{pieces}], dim=1)")
    elif v == "cat_self_back":
        st.emit("h = torch.cat([h, h[:, :1]], dim=1)")
    st.off += delta


def _emit_index(st: _State, s: Step) -> None:
    v = s.get("v")
    code = {
        "index_select_id": "h = torch.index_select(h, 1, torch.arange(h.shape[1]))",
        "index_select_rev": "h = torch.index_select(h, 1, torch.arange(h.shape[1]).flip(0))",
        "gather_id": ("h = torch.gather(h, 1, torch.arange(h.shape[1])[None, :, None]"
                      ".expand(h.shape[0], -1, h.shape[2]))"),
        "take_along_id": "h = torch.take_along_dim(h, torch.arange(h.shape[1])[None, :, None], dim=1)",
        "adv_id": "h = h[:, torch.arange(h.shape[1])]",
        "adv_prev": "h = h[:, (torch.arange(h.shape[1]) - 1).clamp(min=0)]",
        "adv_next": "h = h[:, (torch.arange(h.shape[1]) + 1) % h.shape[1]]",
        "adv_minus1": "h = h + h[:, torch.arange(h.shape[1]) - 1]",
        "adv_half": "h = h[:, torch.arange(h.shape[1]) // 2]",
        "narrow_id": "h = h.narrow(1, 0, h.shape[1])",
        "index_neg_last": "h = h + h[:, -1][:, None, :]",
    }.get(v)
    if v in ("table_emb", "table_index", "table_short"):
        # a static table looked up by position; "table_short" has fewer rows than the largest bucket (but enough for
        # every call length eagerly): the planner must not pad calls into buckets past it
        longest = max(prog_lengths(st)) + st.off
        rows = longest + 1 if v == "table_short" else max(st.buckets) + MAX_OFF
        t = st.param((rows, st.d), 1.0)
        st.emit(f"h = h + F.embedding(torch.arange(h.shape[1]), {t})" if v != "table_index"
                else f"h = h + {t}[torch.arange(h.shape[1])]")
        return
    if v == "ids_gather":
        if st.off != 0:
            return st.skip("ids_gather needs the stream aligned with ids")
        st.uses_ids = True
        st.emit("h = torch.gather(h, 1, (ids % h.shape[1])[..., None].expand(-1, -1, h.shape[2]))")
        return
    st.emit(code)


def _emit_intpos(st: _State, s: Step) -> None:
    use, dt, shift = s.get("use"), s.get("dt"), s.get("shift")
    if use in ("index", "index_shift"):
        shift = min(shift, 0) if dt != "uint8" else 0  # out of range eagerly (a later row, or uint8's 0 - 1 = 255)
    sh = f" + {shift}" if shift > 0 else f" - {-shift}" if shift < 0 else ""
    st.emit(f"pos = torch.arange(h.shape[1]).to(torch.{dt}){sh}")
    if use == "index":
        st.emit("h = h[:, pos.long()]")
    elif use == "index_shift":
        st.emit("h = h + h[:, pos.long() - 1]" if dt == "uint8" else "h = h + h[:, (pos - 1).long()]")
    elif use == "bias":
        st.emit("h = h + pos[None, :, None].to(h.dtype) * 0.01")
    elif use == "cmp_matmul":
        st.inexact = True
        st.emit("w = (pos[None, :] <= pos[:, None]).to(h.dtype)", "h = w @ h")
    elif use == "cmp_cummean":
        st.inexact = True
        st.emit("w = (pos[None, :] <= pos[:, None]).to(h.dtype)",
                "h = (w / w.sum(-1, keepdim=True).clamp(min=1.0)) @ h")


def _attn_mask_lines(s: Step, mask: str, cast: str, am_keys: str | None, and_am: bool) -> tuple[list[str], str]:
    """The lines building an attention step's mask, and the SDPA keyword that passes it."""
    oq, ok, cmp, window = (s.get(n) for n in ("oq", "ok", "cmp", "window"))
    lines: list[str] = []
    kw = ""
    if mask in ("bool", "add_sdpa", "manual_add", "manual_bool"):
        lines += [f"qp = torch.arange(q.shape[2]){cast}" + (f" + {oq}" if oq > 0 else f" - {-oq}" if oq < 0 else ""),
                  f"kp = torch.arange(k.shape[2]){cast}" + (f" + {ok}" if ok > 0 else f" - {-ok}" if ok < 0 else ""),
                  f"m = kp[None, :] {'<=' if cmp == 'le' else '<'} qp[:, None]"]
        if window:
            lines.append(f"m = m & ((qp[:, None] - kp[None, :]) < {window})")
        if s.get("or_false"):
            lines.append("m = m | torch.zeros_like(m)")
        lines.append("m = m[None, None]")
        if am_keys and and_am:
            lines.append(f"m = m & {am_keys}.bool()[:, None, None, :]")
        if mask == "bool":
            kw = ", attn_mask=m"
        elif mask == "add_sdpa":
            lines.append("a = torch.where(m, 0.0, torch.finfo(q.dtype).min)")
            kw = ", attn_mask=a"
    elif mask == "causal":
        kw = ", is_causal=True"
    elif mask == "keys_am":
        lines.append(f"m = {am_keys}.bool()[:, None, None, :]")
        kw = ", attn_mask=m"
    elif mask == "legacy_am":
        lines.append(f"a = (1.0 - {am_keys}[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min")
        kw = ", attn_mask=a"
    return lines, kw


def _emit_attn(st: _State, s: Step) -> None:
    src, mask = s.get("src"), s.get("mask")
    oq, ok, cmp, window, and_am, proj, int_dt = (s.get(n) for n in ("oq", "ok", "cmp", "window", "and_am", "proj",
                                                                   "int_dt"))
    st.inexact = True
    if st.d % 2:
        return st.skip("attention needs an even hidden size")
    d, hd = st.d, st.d // 2
    # query and key rows relative to the stream, and their offsets from L
    qsrc, ksrc, q_off, k_off = "h", "h", st.off, st.off
    if src == "shift_k1":
        ksrc, k_off = "h[:, 1:]", st.off - 1
    elif src == "k_drop_last":
        ksrc, k_off = "h[:, :-1]", st.off - 1
    elif src == "k_shift_right":
        ksrc = "F.pad(h[:, :-1], (0, 0, 1, 0))"
    elif src == "shift_q1":
        qsrc, q_off = "h[:, 1:]", st.off - 1
    if MIN_LEN + min(q_off, k_off) < MIN_S:
        return st.skip("attention's slice would leave too few rows")
    lines = []
    if proj:
        wq, wk, wv = (st.param((d, d)) for _ in range(3))
        lines += [f"q = F.linear({qsrc}, {wq})", f"k = F.linear({ksrc}, {wk})", f"v = F.linear({ksrc}, {wv})"]
    else:
        lines += [f"q = {qsrc}", f"k = {ksrc}", "v = k * 0.5 + 0.1"]
    lines += [f"k = k.unflatten(-1, (2, {hd})).transpose(1, 2)", f"v = v.unflatten(-1, (2, {hd})).transpose(1, 2)"]
    if src == "static_q":
        sq = st.param((1, 2, s.get("q_len"), hd), 1.0)
        lines.append(f"q = {sq}.expand(h.shape[0], -1, -1, -1)")
    else:
        lines.append(f"q = q.unflatten(-1, (2, {hd})).transpose(1, 2)")
    # masks
    cast = f".to(torch.{int_dt})" if int_dt else ""
    am_keys = None
    if mask in ("keys_am", "legacy_am") or and_am:
        if k_off == 0 and src not in ("k_shift_right",):
            st.uses_mask = True
            am_keys = "attention_mask"
        elif mask in ("keys_am", "legacy_am"):
            mask = "none"
    more, kw = _attn_mask_lines(s, mask, cast, am_keys, and_am)
    lines += more
    if mask in ("manual_add", "manual_bool"):
        lines.append(f"sc = (q @ k.transpose(-1, -2)) * {1 / math.sqrt(hd):.6g}")
        if mask == "manual_add":
            lines.append("sc = sc + torch.where(m, 0.0, torch.finfo(sc.dtype).min)")
        else:
            lines.append("sc = sc.masked_fill(~m, float('-inf'))")
        if s.get("sink"):  # a learned sink logit per head appended after the keys, its weight dropped again
            sink = st.param((1, 2, 1, 1), 1.0)
            lines += [f"sc = torch.cat([sc, {sink}.expand(sc.shape[0], -1, sc.shape[2], -1)], dim=-1)",
                      "o = sc.softmax(-1)[..., :-1] @ v"]
        else:
            lines.append("o = sc.softmax(-1) @ v")
    else:
        lines.append(f"o = F.scaled_dot_product_attention(q, k, v{kw})")
    _attn_out(st, lines, src, q_off)


def _attn_out(st: _State, lines: list[str], src: str, q_off: int) -> None:
    """An attention step's result back into the stream (or the outputs, for static queries)."""
    lines.append("o = o.transpose(1, 2).flatten(2)")
    if src == "static_q":
        lines.append("outs.append(o)")
    elif q_off == st.off:
        lines.append("h = h + o")
    else:
        lines.append("h = o")
        st.off = q_off
    st.emit(*lines)


def _emit_conv(st: _State, s: Step) -> None:
    k, dil, p, cut, act = (s.get(n) for n in ("k", "dilation", "padding", "cut", "act"))
    st.inexact = True
    extra = 2 * p - (k - 1) * dil  # output rows minus input rows
    if cut == "prefix" and extra < 0:
        cut = "none"
    new = {"prefix": st.off, "none": st.off + extra, "left2": st.off + extra - 2, "centre": st.off + extra - 2}[cut]
    if MIN_LEN + new < MIN_S or new > MAX_OFF:
        return st.skip("this convolution would leave too few (or too many) rows")
    w = st.param((st.d, 1, k), 0.5)
    st.emit(f"c = F.conv1d(h.transpose(1, 2), {w}, padding={p}, dilation={dil}, groups={st.d})")
    if act:
        st.emit("c = F.silu(c)")
    st.emit({"prefix": "c = c[..., : h.shape[1]]", "none": "", "left2": "c = c[..., 2:]",
             "centre": "c = c[..., 1:-1]"}[cut])
    st.emit("h = c.transpose(1, 2)")
    st.off = new
    st.fwd = [ln for ln in st.fwd if ln]


def _emit_reshape(st: _State, s: Step) -> None:
    v = s.get("v")
    d = st.d
    if v in ("heads_roundtrip",) and d % 2:
        return st.skip("needs an even hidden size")
    code = {
        "heads_roundtrip": [f"h = h.unflatten(-1, (2, {d // 2})).transpose(1, 2)", "h = h * 1.0",
                            "h = h.transpose(1, 2).flatten(2)"],
        "merge_batch": [f"t = h.reshape(-1, {d})", f"t = F.layer_norm(t, ({d},))",
                        f"h = h + t.view(h.shape[0], -1, {d})"],
        "merge_batch_wrong": [f"t = h.transpose(0, 1).reshape(-1, {d})", f"h = t.view(h.shape[0], -1, {d})"],
        "merge_hidden": ["t = h.reshape(h.shape[0], -1)", f"h = t.view(h.shape[0], -1, {d})"],
        "merge_hidden_wrong": ["t = h.reshape(h.shape[0], -1)", f"h = t.view(h.shape[0], {d}, -1).transpose(1, 2)"],
        "flatten_unflatten": [f"h = h.flatten(1).unflatten(1, (-1, {d}))"],
        "flatten_unflatten_wrong": [f"h = h.flatten(1).unflatten(1, ({d}, -1)).transpose(1, 2)"],
        "permute_roundtrip": ["h = h.permute(2, 0, 1).contiguous()", "h = h.permute(1, 2, 0)"],
        "repeat_view": [f"h = h.repeat(1, 2, 1).view(h.shape[0], 2, -1, {d}).mean(1)"],
        "repeat_view_wrong": [f"h = h.repeat(1, 2, 1).view(h.shape[0], -1, 2, {d}).mean(2)"],
        "expand_merge_wrong": [f"t = h.unsqueeze(1).expand(-1, 2, -1, -1).reshape(h.shape[0], -1, {d})",
                               f"h = t.view(h.shape[0], -1, 2, {d}).sum(2)"],
    }[v]
    if v in ("merge_batch", "repeat_view", "repeat_view_wrong", "expand_merge_wrong"):
        st.inexact = True
    st.emit(*code)


def _emit_mix(st: _State, s: Step) -> None:
    v = s.get("v")
    st.inexact = True
    st.emit({"gram": "h = h @ (h.transpose(1, 2) @ h) * 0.01",
             "einsum_seq": "h = torch.einsum('bst,btd->bsd', torch.einsum('bsd,btd->bst', h, h).softmax(-1), h)",
             "outer_seq": "h = h + (h.transpose(1, 2) @ torch.ones_like(h[..., :1])).transpose(1, 2) * 0.1"}[v])


def _emit_ids(st: _State, s: Step) -> None:
    v = s.get("v")
    if st.off != 0:
        return st.skip("ids steps need the stream aligned with ids")
    st.uses_ids = True
    if v == "emb":
        e = st.param((V, st.d), 1.0)
        st.emit(f"h = h + F.embedding(ids, {e})")
    elif v == "ids_mask":
        st.emit("h = h * (ids != 0)[..., None]")
    elif v == "ids_cumsum":
        st.emit("h = h + (ids != 0).cumsum(1)[..., None] * 0.1")
    elif v == "ids_count":
        st.emit("h = h + (ids != 0).sum(1)[:, None, None] * 0.1")


def _emit_mask(st: _State, s: Step) -> None:
    v = s.get("v")
    am = st.am_rows()
    if am is None:
        return st.skip("mask steps need the stream aligned with attention_mask")
    code = {
        "mul": [f"h = h * {am}[..., None]"],
        "count": [f"h = h + {am}.sum(1)[:, None, None] * 0.1"],
        "left_count": [f"h = h + ({am}.long().cumsum(-1) == 0).sum(-1)[:, None, None] * 0.1"],
        "eq0_count": [f"h = h + ({am} == 0).sum(-1)[:, None, None] * 0.1"],
        "cumsum_pos": [f"h = h + ({am}.long().cumsum(-1) - 1)[..., None] * 0.1"],
        "any_pad": [f"h = h + ({am} == 0).any(-1)[:, None, None] * 1.0"],
        "left_count_int8": [f"h = h + ({am}.long().cumsum(-1).to(torch.int8) == 0).sum(-1)[:, None, None] * 0.1"],
        "left_count_uint8": [f"h = h + ({am}.long().cumsum(-1).to(torch.uint8) == 0).sum(-1)[:, None, None] * 0.1"],
    }[v]
    st.emit(*code)


def _emit_sortlike(st: _State, s: Step) -> None:
    v = s.get("v")
    st.emit({"sort_s": "h = h.sort(1).values",
             "sort_h": "h = h.sort(-1).values",
             "topk_h": "h = h + h.topk(2, dim=-1).values.sum(-1, keepdim=True)",
             "topk_s": "h = h + h.topk(2, dim=1).values.sum(1, keepdim=True)",
             "flip_s": "h = h.flip(1)",
             "flip_h": "h = h.flip(-1)",
             "roll_s": "h = torch.roll(h, 1, dims=1)",
             "roll_h": "h = torch.roll(h, 1, dims=2)",
             "argmax_s_side": "outs.append(h.argmax(1))"}[v])
    if v in ("topk_h", "topk_s"):
        st.inexact = True


def _emit_value(st: _State, s: Step) -> None:
    v = s.get("v")
    st.emit({"mul_len": "h = h * h.shape[1]",
             "arange_frac": "h = h + (torch.arange(h.shape[1]) / h.shape[1])[None, :, None]",
             "arange_bias": "h = h + torch.arange(h.shape[1])[None, :, None] * 0.01",
             "full_len": "h = h + torch.full((1, 1, 1), h.shape[1])"}[v])


def _emit_side(st: _State, s: Step) -> None:
    v = s.get("v")
    if v in ("side_pool", "side_cumsum"):
        st.inexact = True
    st.emit({"side_h": "outs.append(h * 1.0)",
             "side_last": "outs.append(h[:, -1])",
             "side_first": "outs.append(h[:, 0])",
             "side_pool": "outs.append(h.mean(1))",
             "side_x_last": "outs.append(x[:, -1] * 2.0)",
             "side_cumsum": "outs.append(h.cumsum(1)[:, -1])"}[v])


_EMIT: dict[str, Callable[[_State, Step], None]] = {
    "pointwise": _emit_pointwise, "linear": _emit_linear, "reduce": _emit_reduce, "scan": _emit_scan,
    "slice": _emit_slice, "repad": _emit_repad, "index": _emit_index, "intpos": _emit_intpos, "attn": _emit_attn,
    "conv": _emit_conv, "reshape": _emit_reshape, "mix": _emit_mix, "ids": _emit_ids, "mask": _emit_mask,
    "sortlike": _emit_sortlike, "value": _emit_value, "side": _emit_side,
}


@dataclass(frozen=True)
class _Built:
    source: str
    uses_ids: bool
    uses_mask: bool
    inexact: bool


def _interpret(prog: Program) -> _Built:
    st = _State(prog.buckets, (LARGE if prog.large else SMALL)[1])
    for i, s in enumerate(prog.steps):
        st.emit(f"# step {i}: {s}")
        _EMIT[s.kind](st, s)
    args = ["x"] + (["ids"] if st.uses_ids else []) + (["attention_mask"] if st.uses_mask else [])
    lines = [
        "import torch",
        "import torch.nn as nn",
        "import torch.nn.functional as F",
        "",
        "",
        "class Program(nn.Module):",
        f"    # {prog}",
        "    def __init__(self):",
        "        super().__init__()",
        f"        g = torch.Generator().manual_seed({prog.seed})",
        *("        " + ln for ln in st.init),
        "",
        f"    def forward(self, {', '.join(args)}):",
        "        h = x",
        "        outs = []",
        *("        " + ln for ln in st.fwd),
        "        return (h, *outs)",
    ]
    return _Built("\n".join(lines) + "\n", st.uses_ids, st.uses_mask, st.inexact)


def program_source(prog: Program) -> str:
    """The Python source of ``prog`` as an ``nn.Module`` named ``Program`` (what :func:`build_module` runs)."""
    return _interpret(prog).source


_N_BUILT = [0]


def build_module(prog: Program) -> torch.nn.Module:
    """``prog``'s module, executed from :func:`program_source` (registered with ``linecache`` so tracebacks, Dynamo
    and the proof's messages show its lines)."""
    src = program_source(prog)
    _N_BUILT[0] += 1
    filename = f"<padding_fuzz program {prog.seed} #{_N_BUILT[0]}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    ns: dict[str, Any] = {"__name__": f"padding_fuzz_program_{prog.seed}"}
    exec(compile(src, filename, "exec"), ns)  # noqa: S102 - the fuzzer's own generated program
    return ns["Program"]().eval()


# ----------------------------------------------------------------------------------------------------------------
# Running one program: the full path
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Result:
    """What one program did. ``category``: one of :data:`CATEGORIES`; ``padded``: the call lengths that ran padded
    (at their bucket's length); ``wrong``: ``(length, output index, what differs)`` for every padded call that differs
    from eager; ``detail``: the refusal, the error, or the first difference."""

    program: Program
    category: str
    padded: tuple[int, ...] = ()
    wrong: tuple[tuple[int, int, str], ...] = ()
    detail: str = ""
    seconds: float = 0.0
    shrunk: Program | None = None

    @property
    def families(self) -> set[str]:
        return {s.kind for s in self.program.steps}


class _RecordingDelegate:
    """A ``then=`` delegate that runs the graph as it is (like ``then="eager"``) and records, per run of the compiled
    function, the length dim of every ``[B, n, ...]`` tensor argument (``x``, ``ids``, ``attention_mask``; the weights
    never have ``B`` rows first): a run at the bucket's length instead of the call's was padded."""

    __name__ = "padding_fuzz_recorder"

    def __init__(self) -> None:
        self.runs: list[set[int]] = []
        self.compiles = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        self.compiles += 1
        forward = gm.forward
        runs = self.runs

        def run(*args: Any) -> Any:
            runs.append({int(a.shape[1]) for a in args if isinstance(a, torch.Tensor) and a.dim() in (2, 3)
                         and a.shape[0] == B})
            return forward(*args)

        return run


def _inputs(prog: Program, built: _Built, n: int, call: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(prog.seed * 1009 + n)
    out = {"x": torch.randn(B, n, H, generator=g)}
    if built.uses_ids:
        out["ids"] = torch.randint(0, V, (B, n), generator=g)
    if built.uses_mask:
        m = torch.ones(B, n, dtype=torch.long)
        if call == 1:  # one call with leading zeros (a left-padded row): the per-call checks see it
            m[1, :2] = 0
        out["attention_mask"] = m.bool() if prog.mask_bool else m
    return out


def _first_difference(got: Any, want: Any, exact: bool) -> tuple[int, str] | None:
    got_t = list(got) if isinstance(got, (tuple, list)) else [got]
    want_t = list(want) if isinstance(want, (tuple, list)) else [want]
    if len(got_t) != len(want_t):
        return -1, f"{len(got_t)} outputs, eager has {len(want_t)}"
    for k, (a, b) in enumerate(zip(got_t, want_t)):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            if a != b:
                return k, f"{a!r} vs {b!r}"
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return k, f"shape/dtype {tuple(a.shape)} {a.dtype} vs eager's {tuple(b.shape)} {b.dtype}"
        if not (a.is_floating_point() or a.is_complex()):
            if not torch.equal(a, b):
                return k, f"integer values differ at {int((a != b).sum())} positions"
            continue
        na, nb = a.isnan(), b.isnan()
        if not torch.equal(na, nb):
            return k, f"NaN at {int((na ^ nb).sum())} positions of one only"
        a0, b0 = a.masked_fill(na, 0), b.masked_fill(nb, 0)
        if exact:
            if not torch.equal(a0, b0):
                return k, f"not bitwise equal (largest difference {(a0 - b0).abs().max().item():.3g})"
            continue
        fa, fb = a0.isfinite(), b0.isfinite()
        if not torch.equal(fa, fb) or not torch.equal(a0[~fa], b0[~fb]):
            return k, "infinities differ"
        if not fa.any():
            continue
        scale = 1.0 + b0[fb].abs().max().item()
        diff = (a0[fa] - b0[fb]).abs()
        bad = diff > 1e-5 * scale + 1e-5 * b0[fb].abs()
        if bad.any():
            return k, f"largest difference {diff.max().item():.3g} (eager's largest |value| {scale - 1:.3g})"
    return None


def _is_graphpass_error(err: BaseException) -> bool:
    from ..errors import GraphpassError

    seen = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, GraphpassError):
            return True
        e = e.__cause__ or e.__context__
    return False


def _short_error(err: BaseException) -> str:
    tb = traceback.extract_tb(err.__traceback__)
    where = f" ({tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})" if tb else ""
    msg = str(err).strip().splitlines()
    return f"{type(err).__name__}: {msg[0][:300] if msg else ''}{where}"


def _all_refused(gp: Any) -> str | None:
    """The first refusal when every graph graphpass planned so far was refused (no later call can pad), else None."""
    plans = [r.analysis.bucket_plan for r in gp.graphs]
    if plans and all(p is not None and p.refused for p in plans):
        return plans[0].refused[0]
    return None


def run_program(prog: Program) -> Result:
    """Compile ``prog`` with graphpass's bucketing (a recording delegate) and check every padded call against eager
    (see the module's docstring). Once every graph's plan is refused after a call, the remaining lengths are not
    called (no call can pad any more)."""
    import graphpass

    t0 = time.perf_counter()
    built = _interpret(prog)
    try:
        module = build_module(prog)
    except Exception as err:  # noqa: BLE001 - a generator bug: reported, never counted against graphpass
        return Result(prog, "invalid", detail=_short_error(err), seconds=time.perf_counter() - t0)
    names = ["x"] + (["ids"] if built.uses_ids else []) + (["attention_mask"] if built.uses_mask else [])
    fills = {"x": prog.x_fill, "ids": prog.ids_fill, "attention_mask": prog.mask_fill}
    rec = _RecordingDelegate()
    torch._dynamo.reset()
    gp = graphpass.backend(then=rec, static_shapes={"dims": {n: 1 for n in names}, "buckets": list(prog.buckets),
                                                    "pad_value": {n: fills[n] for n in names}})
    compiled = torch.compile(module, backend=gp)
    padded: list[int] = []
    wrong: list[tuple[int, int, str]] = []
    refused = None
    try:
        # Dynamo's fake-tensor memo cache pays for entries no later program reuses (each program is new code)
        with torch.no_grad(), warnings.catch_warnings(), torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
            warnings.simplefilter("ignore")
            for i, n in enumerate(prog.call_lengths):
                inp = _inputs(prog, built, n, i)
                try:
                    want = module(**inp)
                except Exception as err:  # noqa: BLE001 - a generator bug
                    return Result(prog, "invalid", detail=_short_error(err), seconds=time.perf_counter() - t0)
                if i == 0:
                    for t in inp.values():
                        torch._dynamo.maybe_mark_dynamic(t, 1)
                start = len(rec.runs)
                got = compiled(**inp)
                lengths = set().union(*rec.runs[start:]) if len(rec.runs) > start else set()
                if lengths and n not in lengths:
                    padded.append(n)
                    diff = _first_difference(got, want, exact=not built.inexact)
                    if diff is not None:
                        wrong.append((n, diff[0], diff[1]))
                refused = _all_refused(gp)
                if refused is not None and not padded:
                    break
    except Exception as err:  # noqa: BLE001 - a crash in compiling or calling: reported
        cat = "graphpass_error" if _is_graphpass_error(err) else "error"
        return Result(prog, cat, tuple(padded), tuple(wrong), _short_error(err), time.perf_counter() - t0)
    finally:
        torch._dynamo.reset()
    return _verdict(prog, gp, padded, wrong, refused, time.perf_counter() - t0)


def _verdict(prog: Program, gp: Any, padded: list, wrong: list, refused: str | None, seconds: float) -> Result:
    """The result of a program whose every call ran: refused, exact, WRONG, or a graph break."""
    if not padded and gp.graphs and all(r.analysis.bucket_plan is None for r in gp.graphs):
        return Result(prog, "refused", (), (), f"not bucketed: {len(gp.graphs)} graphs without a symbolic length "
                      "(Dynamo specialized it)", seconds)
    if len(gp.graphs) > 1 and any(r.analysis.bucket_plan is None for r in gp.graphs) and not padded:
        return Result(prog, "graph_break", tuple(padded), tuple(wrong), f"{len(gp.graphs)} graphs", seconds)
    if wrong:
        n, k, what = wrong[0]
        return Result(prog, "WRONG", tuple(padded), tuple(wrong), f"length {n}, output {k}: {what}", seconds)
    if padded:
        return Result(prog, "exact", tuple(padded), (), "", seconds)
    return Result(prog, "refused", (), (), refused or "no call padded (per-call checks)", seconds)


# ----------------------------------------------------------------------------------------------------------------
# Shrinking
# ----------------------------------------------------------------------------------------------------------------

#: Per family, simpler values to try for each parameter (first the simplest).
_SIMPLER: dict[str, dict[str, tuple[Any, ...]]] = {
    "attn": {"sink": (False,), "or_false": (False,), "proj": (False,), "and_am": (False,), "window": (None,),
             "int_dt": (None,), "oq": (0,), "ok": (0,),
             "cmp": ("le",), "src": ("self",), "mask": ("causal", "bool", "none")},
    "conv": {"act": (False,), "dilation": (1,), "k": (1, 2, 3), "cut": ("prefix", "none")},
    "intpos": {"shift": (0,), "dt": ("int64",)},
}


def _candidates(prog: Program) -> Iterable[Program]:
    steps = prog.steps
    for i in range(len(steps)):
        yield replace(prog, steps=steps[:i] + steps[i + 1:])
    for i, s in enumerate(steps):
        for name, values in _SIMPLER.get(s.kind, {}).items():
            for v in values:
                if s.get(name) != v and name in dict(s.params):
                    yield replace(prog, steps=steps[:i] + (s.with_(**{name: v}),) + steps[i + 1:])
    if prog.x_fill not in (1.5,):
        yield replace(prog, x_fill=1.5)
    if prog.mask_bool:
        yield replace(prog, mask_bool=False)
    if prog.ids_fill:
        yield replace(prog, ids_fill=0)
    if prog.mask_fill:
        yield replace(prog, mask_fill=0)


def shrink(result: Result, run: Callable[[Program], Result] = run_program, budget: int = 60) -> Result:
    """Greedily shrink a failing ``result``'s program (drop steps, simplify parameters and fills, keep the failing
    lengths) while it fails the same way (same category); at most ``budget`` runs. Returns the smallest failing
    result, with ``shrunk`` set."""
    cat = result.category
    best = result
    if cat == "WRONG":
        first_bad = best.wrong[0][0]
        keep = tuple(dict.fromkeys((best.program.call_lengths[0], first_bad)))
        trial = run(replace(best.program, lengths=keep))
        budget -= 1
        if trial.category == cat:
            best = trial
    improved = True
    while improved and budget > 0:
        improved = False
        for cand in _candidates(best.program):
            if budget <= 0:
                break
            budget -= 1
            got = run(cand)
            if got.category == cat and (cat != "error" or got.detail.split(":")[0] == best.detail.split(":")[0]):
                best = got
                improved = True
                break
    return replace(result, shrunk=best.program, detail=result.detail if best is result else
                   f"{result.detail}; shrunk: {best.detail}")


def format_failure(result: Result) -> str:
    """A failure as text: the category, what differed, and the (shrunk) program's Python source."""
    prog = result.shrunk or result.program
    built = _interpret(prog)
    fills = {"x": prog.x_fill, "ids": prog.ids_fill, "attention_mask": prog.mask_fill}
    names = ["x"] + (["ids"] if built.uses_ids else []) + (["attention_mask"] if built.uses_mask else [])
    cfg = {"dims": {n: 1 for n in names}, "buckets": list(prog.buckets), "pad_value": {n: fills[n] for n in names}}
    return (f"[{result.category}] seed {result.program.seed}: {result.detail}\n"
            f"# static_shapes={cfg}, lengths {list(prog.call_lengths)}"
            f"{', attention_mask as bool' if prog.mask_bool and built.uses_mask else ''}\n"
            + program_source(prog))


# ----------------------------------------------------------------------------------------------------------------
# Many programs
# ----------------------------------------------------------------------------------------------------------------


def fuzz(seeds: Iterable[int], shrink_failures: bool = True, run: Callable[[Program], Result] = run_program,
         on_result: Callable[[Result], None] | None = None) -> list[Result]:
    """Run the programs of ``seeds``; failures (``WRONG``, ``error``) shrunk when ``shrink_failures``."""
    out = []
    for seed in seeds:
        r = run(generate(seed))
        if r.category in ("WRONG", "error") and shrink_failures:
            r = shrink(r, run)
            log.warning("padding fuzz: %s", format_failure(r))
        elif r.category in ("invalid", "graph_break"):
            log.info("padding fuzz: seed %d %s: %s", seed, r.category, r.detail)
        out.append(r)
        if on_result is not None:
            on_result(r)
    return out


def summarize(results: Sequence[Result]) -> dict[str, Any]:
    """Counts: per category, and per op family the programs with a step of it and how many of them were padded."""
    counts = {c: 0 for c in CATEGORIES}
    fam: dict[str, list[int]] = {f: [0, 0] for f in FAMILIES}
    for r in results:
        counts[r.category] += 1
        for f in r.families:
            fam[f][0] += 1
            fam[f][1] += r.category in ("exact", "WRONG")
    return {"programs": len(results), "counts": counts, "families": fam,
            "seconds": sum(r.seconds for r in results)}
