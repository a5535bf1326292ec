"""Dynamo's guards on a padded length, read as facts for a graph proven through a causal function's code.

A graph traced at a length that is a multiple of a chunk size takes the branch of the proven code where nothing is
padded (``if pad_size > 0`` not taken) and Dynamo guards on it (``Mod(8 - Mod(s, 8), 8) <= 0``). Its row counts are
then written ``s + Mod(8 - Mod(s, 8), 8)`` or ``(s // 8) * 8``: the padded length itself at every length the guard
admits, though not the bare symbol. :func:`multiples_from_guards` reads such a guard as ``s % 8 == 0``, and
:class:`MultipleCanon` rewrites such a size into ``s`` (through :func:`..fx_utils.canonical_sizes`, so every
rule reads it so), and :class:`MultipleBuckets` marks the buckets that are not a multiple invalid.

Soundness: every bucket the graph runs at is a multiple (:class:`MultipleBuckets`), where each rewritten size is
what it is rewritten to. A guard excused as benign (:func:`..causal_functions.benign_guard`) is not checked at the
buckets, so it is never read as a fact.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import sympy

from ..causal_functions import benign_guard

__all__ = ["MultipleBuckets", "MultipleCanon", "guard_where", "multiples_from_guards"]

_MAX_MODULUS = 4096  # a chunk size; larger moduli are not read (each is checked residue by residue)
_K = sympy.Symbol("graphpass_k", integer=True, nonnegative=True)


def guard_where(guard: Any) -> str:
    """A guard's source location as ``benign_guard`` reads it (``"<code>  # <file>:<line> in <function>"``),
    without the torch-internal frame Dynamo appends."""
    return re.sub(r"\s*\((_dynamo|torch)/[^()]*\)$", "", str(getattr(guard, "sloc", "")))


def _mods_of(expr: sympy.Basic, s: sympy.Symbol) -> dict[int, list[sympy.Basic]]:
    """``c`` -> the atoms ``Mod(s, c)`` of ``expr`` (torch's ``Mod`` / ``PythonMod``), for ``1 < c <= 4096``."""
    out: dict[int, list[sympy.Basic]] = {}
    for atom in expr.atoms(sympy.Function):
        if type(atom).__name__ in ("Mod", "PythonMod") and len(atom.args) == 2 and atom.args[0] == s:
            c = atom.args[1]
            if c.is_Integer and 1 < int(c) <= _MAX_MODULUS:
                out.setdefault(int(c), []).append(atom)
    return out


def _implies_multiple(expr: sympy.Basic, s: sympy.Symbol, c: int, mods: list[sympy.Basic]) -> bool:
    """Whether ``expr`` (true at the traced length) is false at every ``s`` that is not a multiple of ``c``:
    ``s = c*k + r`` with ``k`` a symbolic integer >= 0, for every residue ``r`` in 1 .. c-1 (``mods``: the atoms
    ``Mod(s, c)`` of ``expr``)."""
    for r in range(1, c):
        try:  # Mod(s, c) is r exactly where s = c*k + r (torch's Mod does not reduce Mod(c*k + r, c) itself)
            value = expr.xreplace({m: sympy.Integer(r) for m in mods}).xreplace({s: c * _K + r})
        except TypeError:
            return False
        if value is not sympy.false:
            return False
    return True


def multiples_from_guards(
    env: Any, names: Iterable[str], trusted: Iterable[str]
) -> dict[sympy.Symbol, tuple[int, str]]:
    """Padded symbol -> ``(c, the guard)``, where a guard of ``env`` that mentions only that symbol, and that is not
    excused as benign for the ``trusted`` functions, holds only at multiples of ``c`` (the least common multiple
    when several do)."""
    names, trusted = set(names), list(trusted)
    out: dict[sympy.Symbol, tuple[int, str]] = {}
    # a guard recorded before Dynamo found two sizes equal names the one replaced since (s27 -> s16)
    replaced = {k: v for k, v in getattr(env, "replacements", {}).items() if isinstance(v, sympy.Symbol)}
    for guard in getattr(env, "guards", ()) if env is not None else ():
        expr = guard.expr.xreplace(replaced) if replaced else guard.expr
        free = expr.free_symbols
        if len(free) != 1:
            continue
        (s,) = free
        mods = _mods_of(expr, s) if str(s) in names else {}
        if not mods or benign_guard(guard_where(guard), trusted, guard.expr) is not None:
            continue
        for c, atoms in mods.items():
            if _implies_multiple(expr, s, c, atoms):
                out[s] = (math.lcm(out.get(s, (1, ""))[0], c), f"{guard.expr} ({guard_where(guard)})")
    return out


class MultipleCanon:
    """``size_expr``'s canonical form of a size under the multiples (:func:`..fx_utils.canonical_sizes`): an
    expression in one padded symbol ``s`` that equals ``a*s + b`` (integers) at every multiple of ``multiples[s]``
    becomes ``a*s + b``; anything else stays as it is."""

    def __init__(self, multiples: Mapping[sympy.Symbol, int]) -> None:
        self.multiples = dict(multiples)
        self._seen: dict[sympy.Basic, sympy.Basic] = {}

    def __call__(self, expr: sympy.Basic) -> sympy.Basic:
        if not isinstance(expr, sympy.Basic) or expr.is_Symbol or expr.is_Number:
            return expr
        found = self._seen.get(expr)
        if found is None:
            found = self._seen[expr] = self._canon(expr)
        return found

    def _canon(self, expr: sympy.Basic) -> sympy.Basic:
        free = expr.free_symbols
        if len(free) != 1:
            return expr
        (s,) = free
        c = self.multiples.get(s)
        if c is None:
            return expr
        m = sympy.Symbol("graphpass_m", integer=True, positive=True)
        try:
            linear = sympy.expand(sympy.simplify(expr.xreplace({s: c * m})))
            poly = sympy.Poly(linear, m)
        except (TypeError, ValueError, sympy.PolynomialError):
            return expr
        if poly.degree() != 1 or not all(coef.is_Integer for coef in poly.all_coeffs()):
            return expr
        a, b = poly.all_coeffs()
        if a % c:  # a*m + b as a*s/c + b: integer coefficients in s only
            return expr
        return (a // c) * s + b


@dataclass(frozen=True)
class MultipleBuckets:
    """The buckets that are not a multiple of the size a guard requires of the padded length (a graph traced at a
    multiple of a chunk size): the graph is not the code's trace there, and the canonical sizes the proof read
    (:class:`MultipleCanon`) do not hold. ``multiples``: (symbol name, c, the guard)."""

    multiples: tuple[tuple[str, int, str], ...]
    name: str = "length_multiples"

    def mark(self, proof: Any, names: set[str], buckets: tuple[int, ...]) -> None:
        from .result import GuardFails

        for b in buckets:  # every padded size is the bucket: a symbol tied to a bucketed one (``names``) too
            for _sym, c, why in self.multiples:
                if b % c and b not in proof.invalid_buckets:
                    proof.invalid_buckets[b] = GuardFails(f"{why}: the length must be a multiple of {c}")
        if buckets and len(proof.invalid_buckets) == len(buckets):
            sym, c, why = self.multiples[0]
            proof.refused.append(
                f"Dynamo traced this graph for lengths that are a multiple of {c} ({why}); no "
                f"bucket ({', '.join(map(str, buckets))}) is one: make the buckets multiples of {c}"
            )
