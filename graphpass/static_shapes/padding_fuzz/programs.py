"""The fuzzer's programs (see :mod:`graphpass.static_shapes.padding_fuzz`): :class:`Step`, :class:`Program`, the
op families and how each variant is drawn (:func:`generate`)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

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
        return (
            f"Program(seed={self.seed}, buckets={list(self.buckets)}, lengths={list(self.call_lengths)}, "
            f"x_fill={self.x_fill}, ids_fill={self.ids_fill}, mask_fill={self.mask_fill}, "
            f"mask_bool={self.mask_bool}, steps=[{', '.join(map(str, self.steps))}])"
        )


# ----------------------------------------------------------------------------------------------------------------
# The vocabulary: per family, the variants and how each is drawn
# ----------------------------------------------------------------------------------------------------------------

INT_DTYPES = ("int8", "int16", "int32", "uint8", "int64")

_VARIANTS: dict[str, tuple[str, ...]] = {
    "pointwise": (
        "relu",
        "tanh",
        "sigmoid",
        "gelu",
        "silu",
        "affine",
        "abs",
        "square",
        "leaky",
        "masked_fill",
        "exp_clamp",
        "where",
    ),
    "linear": ("linear", "matmul", "einsum", "bmm", "linear_nobias"),
    "reduce": (
        "mean_h",
        "softmax_h",
        "layer_norm",
        "rms_norm",
        "amax_h",
        "logsumexp_h",
        "log_softmax_h",
        "var_h",
        "sum_s",
        "mean_s",
        "softmax_s",
        "amax_s",
        "max_s",
        "log_softmax_s",
        "instance_norm",
        "sum_all",
        "norm_s",
        "logsumexp_s",
        "masked_mean",
    ),
    "scan": (
        "cumsum",
        "cumprod",
        "cummax",
        "logcumsumexp",
        "diff",
        "diff_prepend",
        "diff_append",
        "cumsum_h",
        "flip_cumsum",
    ),
    "slice": (
        "drop_first",
        "drop_last",
        "drop2",
        "narrow_prefix",
        "narrow_shift",
        "neg_n",
        "last_bcast",
        "first_bcast",
        "keep_prefix",
        "last_minus_one",
        "neg_len_x",
        "split_len",
        "split_len_minus",
        "split_tail_read",
        "split_halves",
    ),
    "repad": (
        "pad_left",
        "pad_right",
        "pad_right_value",
        "cat_front",
        "cat_back",
        "cat_self_back",
        "cat_hidden",
        "pad_hidden",
        "shift_right",
        "shift_left",
        "stack_mean",
    ),
    "index": (
        "index_select_id",
        "index_select_rev",
        "gather_id",
        "take_along_id",
        "adv_id",
        "adv_prev",
        "adv_next",
        "adv_minus1",
        "adv_half",
        "narrow_id",
        "ids_gather",
        "index_neg_last",
        "table_emb",
        "table_index",
        "table_short",
    ),
    "intpos": ("index", "index_shift", "bias", "cmp_matmul", "cmp_cummean"),
    "attn": ("sdpa",),
    "conv": ("conv1d",),
    "reshape": (
        "heads_roundtrip",
        "merge_batch",
        "merge_batch_wrong",
        "merge_hidden",
        "merge_hidden_wrong",
        "flatten_unflatten",
        "flatten_unflatten_wrong",
        "permute_roundtrip",
        "repeat_view",
        "repeat_view_wrong",
        "expand_merge_wrong",
    ),
    "mix": ("gram", "einsum_seq", "outer_seq"),
    "ids": ("emb", "ids_mask", "ids_cumsum", "ids_count"),
    "mask": ("mul", "count", "left_count", "eq0_count", "cumsum_pos", "any_pad", "left_count_int8", "left_count_uint8"),
    "sortlike": ("sort_s", "sort_h", "topk_h", "topk_s", "flip_s", "flip_h", "roll_s", "roll_h", "argmax_s_side"),
    "value": ("mul_len", "arange_frac", "arange_bias", "full_len"),
    "side": ("side_h", "side_last", "side_first", "side_pool", "side_x_last", "side_cumsum"),
}

#: Op families (the per-family acceptance rows of the bench).
FAMILIES: tuple[str, ...] = tuple(_VARIANTS)

_WEIGHTS = {
    "attn": 5,
    "conv": 4,
    "reshape": 3,
    "intpos": 3,
    "index": 3,
    "scan": 3,
    "repad": 3,
    "reduce": 3,
    "pointwise": 2,
    "linear": 2,
    "slice": 2,
    "mix": 1,
    "ids": 1,
    "mask": 1.5,
    "sortlike": 1,
    "value": 1,
    "side": 1,
}

#: Per family, the variants this generator expects the proof to accept (a guess, used only to draw them more often:
#: a program is padded only when every step is accepted, and only padded programs test the proof's soundness).
_LIKELY_SAFE: dict[str, tuple[str, ...]] = {
    "pointwise": _VARIANTS["pointwise"],
    "linear": _VARIANTS["linear"],
    "reduce": (
        "mean_h",
        "softmax_h",
        "layer_norm",
        "rms_norm",
        "amax_h",
        "logsumexp_h",
        "log_softmax_h",
        "var_h",
        "masked_mean",
    ),
    "scan": ("cumsum", "cumprod", "cummax", "logcumsumexp", "diff", "diff_prepend", "cumsum_h"),
    "slice": (
        "drop_first",
        "drop_last",
        "drop2",
        "narrow_prefix",
        "narrow_shift",
        "neg_n",
        "first_bcast",
        "keep_prefix",
        "split_len",
        "split_len_minus",
    ),
    "repad": ("pad_left", "cat_front", "cat_hidden", "pad_hidden", "shift_right", "stack_mean"),
    "index": (
        "index_select_id",
        "gather_id",
        "adv_id",
        "narrow_id",
        "adv_prev",
        "table_emb",
        "table_index",
        "table_short",
    ),
    "intpos": ("index", "bias", "cmp_matmul", "cmp_cummean"),
    "attn": ("sdpa",),
    "conv": ("conv1d",),
    "reshape": (
        "heads_roundtrip",
        "merge_batch",
        "merge_hidden",
        "flatten_unflatten",
        "permute_roundtrip",
        "repeat_view",
    ),
    "mix": _VARIANTS["mix"],
    "ids": ("emb", "ids_mask", "ids_cumsum"),
    "mask": ("mul", "count", "left_count", "cumsum_pos"),
    "sortlike": ("sort_h", "topk_h", "flip_h", "roll_h"),
    "value": ("arange_bias",),
    "side": ("side_h", "side_first"),
}

ATTN_SOURCES = ("self", "self", "self", "shift_k1", "k_drop_last", "k_shift_right", "shift_q1", "static_q")
ATTN_MASKS = (
    "causal",
    "causal",
    "bool",
    "bool",
    "add_sdpa",
    "manual_add",
    "manual_bool",
    "none",
    "keys_am",
    "legacy_am",
)
SAFE_PROBABILITY = 0.7  # a step is drawn from the likely-safe variants this often


def _draw_step(rng: random.Random, kind: str) -> Step:
    safe = rng.random() < SAFE_PROBABILITY
    variant = rng.choice((_LIKELY_SAFE if safe else _VARIANTS)[kind])
    if kind == "attn":
        if safe:
            return Step.of(
                "attn",
                src=rng.choice(("self", "self", "self", "k_shift_right")),
                mask=rng.choice(ATTN_MASKS[:7] + ("keys_am", "legacy_am")),
                oq=0,
                ok=rng.choice((0, 0, 1)),
                cmp="le",
                window=rng.choice((None, None, 3)),
                and_am=rng.random() < 0.25,
                proj=rng.random() < 0.5,
                int_dt=rng.choice((None, None, None) + INT_DTYPES[:4]),
                q_len=rng.choice((4, 8)),
                sink=rng.random() < 0.2,
                or_false=rng.random() < 0.2,
            )
        return Step.of(
            "attn",
            src=rng.choice(ATTN_SOURCES),
            mask=rng.choice(ATTN_MASKS),
            oq=rng.choice((0, 0, 0, 1, -1)),
            ok=rng.choice((0, 0, 0, 1, -1)),
            cmp=rng.choice(("le", "le", "lt")),
            window=rng.choice((None, None, None, 3)),
            and_am=rng.random() < 0.25,
            proj=rng.random() < 0.5,
            int_dt=rng.choice((None, None, None) + INT_DTYPES[:4]),
            q_len=rng.choice((4, 8)),
            sink=rng.random() < 0.2,
            or_false=rng.random() < 0.2,
        )
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
    return Program(
        steps=steps,
        seed=seed,
        large=large,
        x_fill=x_fill,
        ids_fill=rng.choice((0, 0, 3)),
        mask_fill=rng.choice((0, 0, 1)),
        mask_bool=rng.random() < 0.25,
    )
