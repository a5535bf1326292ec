"""Module patterns, shared by every option that selects modules (traps, offload, capture).

Syntax:

* a dotted name (``lm_head``, ``model.layers.3``) matches that module exactly;
* a numeric range segment (``layers.0-31``) expands to each index in it before matching;
* anything else is a Python regular expression matched against the whole module name
  (``layers\\.\\d+``, ``.*self_attn``, ``layers.*``).

Names are module FQNs relative to the compiled module (``model.layers.0.mlp``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from .errors import ConfigError, PatternError, PatternMatchError

_PLAIN = re.compile(r"[A-Za-z0-9_.\-]+")  # used with fullmatch: `$` would accept a trailing newline
_RANGE_SEGMENT = re.compile(r"(?:(?<=^)|(?<=\.))(\d+)-(\d+)(?=$|\.)")


@dataclass(frozen=True)
class ModulePattern:
    """One compiled pattern. ``text`` is what the user wrote."""

    text: str
    regex: re.Pattern

    def matches(self, name: str) -> bool:
        return self.regex.fullmatch(name) is not None

    def __repr__(self) -> str:
        return f"ModulePattern({self.text!r})"


def compile_pattern(text: object, key: str) -> ModulePattern:
    """Compile one pattern, raising PatternError naming ``key`` and the pattern on bad input."""
    if not isinstance(text, str):
        raise ConfigError(key, text, f"a module pattern must be a string, not {type(text).__name__}")
    if not text.strip():
        raise PatternError(key, text, "empty module pattern")
    if text != text.strip():
        raise PatternError(key, text, "module pattern has leading or trailing whitespace")
    plain = _PLAIN.fullmatch(text) is not None
    parts: list[str] = []
    pos = 0
    for m in _RANGE_SEGMENT.finditer(text):
        lo, hi = int(m.group(1)), int(m.group(2))
        if lo > hi:
            raise PatternError(key, text, f"reversed range {m.group(0)!r}: write {hi}-{lo}")
        before = text[pos : m.start()]
        parts.append(re.escape(before) if plain else before)
        parts.append("(?:" + "|".join(str(i) for i in range(lo, hi + 1)) + ")")
        pos = m.end()
    tail = text[pos:]
    parts.append(re.escape(tail) if plain else tail)
    source = "".join(parts)
    try:
        regex = re.compile(source)
    except re.error as exc:
        raise PatternError(key, text, f"invalid regular expression: {exc}") from None
    return ModulePattern(text, regex)


def compile_patterns(values: object, key: str) -> tuple[ModulePattern, ...]:
    """Compile a list of patterns for option ``key`` (a single string is refused: wrap it in a list)."""
    if isinstance(values, str):
        raise ConfigError(key, values, "expected a list of module patterns, got a single string; write [%r]" % values)
    if not isinstance(values, (list, tuple)):
        raise ConfigError(key, values, f"expected a list of module patterns, not {type(values).__name__}")
    out = tuple(compile_pattern(v, key) for v in values)
    seen: set[str] = set()
    for p in out:
        if p.text in seen:
            raise PatternError(key, p.text, "pattern listed twice")
        seen.add(p.text)
    return out


def first_match(patterns: Sequence[ModulePattern], name: str) -> ModulePattern | None:
    for p in patterns:
        if p.matches(name):
            return p
    return None


def check_all_match(patterns: Sequence[ModulePattern], names: Iterable[str], key: str) -> None:
    """Raise PatternMatchError for the first pattern that matches none of ``names``."""
    names = list(names)
    for p in patterns:
        if not any(p.matches(n) for n in names):
            close = sorted(n for n in names if n)[:8]
            raise PatternMatchError(
                key, p.text, f"matches no module of the model (some module names: {', '.join(close) or 'none'})"
            )
