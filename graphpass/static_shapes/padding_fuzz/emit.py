"""The fuzzer's interpreter (see :mod:`graphpass.static_shapes.padding_fuzz`): a :class:`Program`'s steps -> the
Python source of an ``nn.Module`` (:func:`program_source`), one emitter per op family, and :func:`build_module`,
which executes that source."""

from __future__ import annotations

import linecache
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .programs import LARGE, MAX_D, MAX_OFF, MIN_LEN, MIN_S, SMALL, H, Program, Step, V

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
    expr = {
        "relu": "torch.relu(h)",
        "tanh": "torch.tanh(h)",
        "sigmoid": "torch.sigmoid(h)",
        "gelu": "F.gelu(h)",
        "silu": "F.silu(h)",
        "affine": "h * 1.5 - 0.25",
        "abs": "h.abs()",
        "square": "h * h",
        "leaky": "F.leaky_relu(h, 0.1)",
        "masked_fill": "h.masked_fill(h > 1.0, 0.0)",
        "exp_clamp": "torch.exp(h.clamp(max=10.0))",
        "where": "torch.where(h > 0, h, 0.1 * h)",
    }[v]
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
        st.emit(
            f"m = {am}[..., None].to(h.dtype)",
            "h = h + (h * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1.0)",
        )
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
    shifts = {
        "drop_first": -1,
        "drop_last": -1,
        "drop2": -2,
        "narrow_prefix": -1,
        "narrow_shift": -1,
        "keep_prefix": -1,
        "last_minus_one": 0,
        "split_len_minus": -1,
        "split_tail_read": -1,
    }
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
        "gather_id": (
            "h = torch.gather(h, 1, torch.arange(h.shape[1])[None, :, None].expand(h.shape[0], -1, h.shape[2]))"
        ),
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
        st.emit(
            f"h = h + F.embedding(torch.arange(h.shape[1]), {t})"
            if v != "table_index"
            else f"h = h + {t}[torch.arange(h.shape[1])]"
        )
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
        st.emit(
            "w = (pos[None, :] <= pos[:, None]).to(h.dtype)", "h = (w / w.sum(-1, keepdim=True).clamp(min=1.0)) @ h"
        )


def _attn_mask_lines(s: Step, mask: str, cast: str, am_keys: str | None, and_am: bool) -> tuple[list[str], str]:
    """The lines building an attention step's mask, and the SDPA keyword that passes it."""
    oq, ok, cmp, window = (s.get(n) for n in ("oq", "ok", "cmp", "window"))
    lines: list[str] = []
    kw = ""
    if mask in ("bool", "add_sdpa", "manual_add", "manual_bool"):
        lines += [
            f"qp = torch.arange(q.shape[2]){cast}" + (f" + {oq}" if oq > 0 else f" - {-oq}" if oq < 0 else ""),
            f"kp = torch.arange(k.shape[2]){cast}" + (f" + {ok}" if ok > 0 else f" - {-ok}" if ok < 0 else ""),
            f"m = kp[None, :] {'<=' if cmp == 'le' else '<'} qp[:, None]",
        ]
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
    oq, ok, cmp, window, and_am, proj, int_dt = (
        s.get(n) for n in ("oq", "ok", "cmp", "window", "and_am", "proj", "int_dt")
    )
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
        lines += _manual_attn_lines(st, s, mask, hd)
    else:
        lines.append(f"o = F.scaled_dot_product_attention(q, k, v{kw})")
    _attn_out(st, lines, src, q_off)


def _manual_attn_lines(st: _State, s: Step, mask: str, hd: int) -> list[str]:
    """Attention written out by hand: the scores, the mask added (``manual_add``) or filled in (``manual_bool``),
    an optional sink logit, the softmax times the values."""
    lines = [f"sc = (q @ k.transpose(-1, -2)) * {1 / math.sqrt(hd):.6g}"]
    if mask == "manual_add":
        lines.append("sc = sc + torch.where(m, 0.0, torch.finfo(sc.dtype).min)")
    else:
        lines.append("sc = sc.masked_fill(~m, float('-inf'))")
    if s.get("sink"):  # a learned sink logit per head appended after the keys, its weight dropped again
        sink = st.param((1, 2, 1, 1), 1.0)
        lines += [
            f"sc = torch.cat([sc, {sink}.expand(sc.shape[0], -1, sc.shape[2], -1)], dim=-1)",
            "o = sc.softmax(-1)[..., :-1] @ v",
        ]
    else:
        lines.append("o = sc.softmax(-1) @ v")
    return lines


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
    st.emit(
        {"prefix": "c = c[..., : h.shape[1]]", "none": "", "left2": "c = c[..., 2:]", "centre": "c = c[..., 1:-1]"}[cut]
    )
    st.emit("h = c.transpose(1, 2)")
    st.off = new
    st.fwd = [ln for ln in st.fwd if ln]


def _emit_reshape(st: _State, s: Step) -> None:
    v = s.get("v")
    d = st.d
    if v in ("heads_roundtrip",) and d % 2:
        return st.skip("needs an even hidden size")
    code = {
        "heads_roundtrip": [
            f"h = h.unflatten(-1, (2, {d // 2})).transpose(1, 2)",
            "h = h * 1.0",
            "h = h.transpose(1, 2).flatten(2)",
        ],
        "merge_batch": [
            f"t = h.reshape(-1, {d})",
            f"t = F.layer_norm(t, ({d},))",
            f"h = h + t.view(h.shape[0], -1, {d})",
        ],
        "merge_batch_wrong": [f"t = h.transpose(0, 1).reshape(-1, {d})", f"h = t.view(h.shape[0], -1, {d})"],
        "merge_hidden": ["t = h.reshape(h.shape[0], -1)", f"h = t.view(h.shape[0], -1, {d})"],
        "merge_hidden_wrong": ["t = h.reshape(h.shape[0], -1)", f"h = t.view(h.shape[0], {d}, -1).transpose(1, 2)"],
        "flatten_unflatten": [f"h = h.flatten(1).unflatten(1, (-1, {d}))"],
        "flatten_unflatten_wrong": [f"h = h.flatten(1).unflatten(1, ({d}, -1)).transpose(1, 2)"],
        "permute_roundtrip": ["h = h.permute(2, 0, 1).contiguous()", "h = h.permute(1, 2, 0)"],
        "repeat_view": [f"h = h.repeat(1, 2, 1).view(h.shape[0], 2, -1, {d}).mean(1)"],
        "repeat_view_wrong": [f"h = h.repeat(1, 2, 1).view(h.shape[0], -1, 2, {d}).mean(2)"],
        "expand_merge_wrong": [
            f"t = h.unsqueeze(1).expand(-1, 2, -1, -1).reshape(h.shape[0], -1, {d})",
            f"h = t.view(h.shape[0], -1, 2, {d}).sum(2)",
        ],
    }[v]
    if v in ("merge_batch", "repeat_view", "repeat_view_wrong", "expand_merge_wrong"):
        st.inexact = True
    st.emit(*code)


def _emit_mix(st: _State, s: Step) -> None:
    v = s.get("v")
    st.inexact = True
    st.emit(
        {
            "gram": "h = h @ (h.transpose(1, 2) @ h) * 0.01",
            "einsum_seq": "h = torch.einsum('bst,btd->bsd', torch.einsum('bsd,btd->bst', h, h).softmax(-1), h)",
            "outer_seq": "h = h + (h.transpose(1, 2) @ torch.ones_like(h[..., :1])).transpose(1, 2) * 0.1",
        }[v]
    )


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
    st.emit(
        {
            "sort_s": "h = h.sort(1).values",
            "sort_h": "h = h.sort(-1).values",
            "topk_h": "h = h + h.topk(2, dim=-1).values.sum(-1, keepdim=True)",
            "topk_s": "h = h + h.topk(2, dim=1).values.sum(1, keepdim=True)",
            "flip_s": "h = h.flip(1)",
            "flip_h": "h = h.flip(-1)",
            "roll_s": "h = torch.roll(h, 1, dims=1)",
            "roll_h": "h = torch.roll(h, 1, dims=2)",
            "argmax_s_side": "outs.append(h.argmax(1))",
        }[v]
    )
    if v in ("topk_h", "topk_s"):
        st.inexact = True


def _emit_value(st: _State, s: Step) -> None:
    v = s.get("v")
    st.emit(
        {
            "mul_len": "h = h * h.shape[1]",
            "arange_frac": "h = h + (torch.arange(h.shape[1]) / h.shape[1])[None, :, None]",
            "arange_bias": "h = h + torch.arange(h.shape[1])[None, :, None] * 0.01",
            "full_len": "h = h + torch.full((1, 1, 1), h.shape[1])",
        }[v]
    )


def _emit_side(st: _State, s: Step) -> None:
    v = s.get("v")
    if v in ("side_pool", "side_cumsum"):
        st.inexact = True
    st.emit(
        {
            "side_h": "outs.append(h * 1.0)",
            "side_last": "outs.append(h[:, -1])",
            "side_first": "outs.append(h[:, 0])",
            "side_pool": "outs.append(h.mean(1))",
            "side_x_last": "outs.append(x[:, -1] * 2.0)",
            "side_cumsum": "outs.append(h.cumsum(1)[:, -1])",
        }[v]
    )


_EMIT: dict[str, Callable[[_State, Step], None]] = {
    "pointwise": _emit_pointwise,
    "linear": _emit_linear,
    "reduce": _emit_reduce,
    "scan": _emit_scan,
    "slice": _emit_slice,
    "repad": _emit_repad,
    "index": _emit_index,
    "intpos": _emit_intpos,
    "attn": _emit_attn,
    "conv": _emit_conv,
    "reshape": _emit_reshape,
    "mix": _emit_mix,
    "ids": _emit_ids,
    "mask": _emit_mask,
    "sortlike": _emit_sortlike,
    "value": _emit_value,
    "side": _emit_side,
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
