"""Golden-graph regression tests for your own models: :func:`assert_golden`, and a pytest plugin
(registered through the ``pytest11`` entry point, so installing graphpass enables it) that adds the
``graphpass_golden`` fixture and the ``--graphpass-accept-golden`` option.

    def test_my_model_graph(graphpass_golden):
        model, inputs = build_model()
        graphpass_golden(model, *inputs)              # golden/<test name>.{txt,summary.json,meta.json}

    graphpass.testing.assert_golden(model, x, name="my_model", directory="tests/golden")

Per model three files in ``directory`` (docs/golden.md): ``<name>.txt``, the exact normalized
rendering (ownership, traps, offload schedule, capture nodes, code), checked only on the torch
release recorded in ``<name>.meta.json``; ``<name>.summary.json``, the structural summary, checked
on every torch version. Re-accept with ``--graphpass-accept-golden`` or ``GRAPHPASS_ACCEPT_GOLDEN=1``;
record the running torch release's own exact goldens beside the main ones (``<name>.torch2.9.txt``
where it renders differently) with ``--graphpass-accept-golden-release`` or
``GRAPHPASS_ACCEPT_GOLDEN=release``.

This module imports torch and graphpass only when a check runs, so the plugin costs pytest runs
that do not use it nothing.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

__all__ = ["assert_golden", "golden_check", "check_goldens", "GoldenResult", "golden_paths"]

ACCEPT_OPTION = "--graphpass-accept-golden"
ACCEPT_RELEASE_OPTION = "--graphpass-accept-golden-release"
DIR_INI = "graphpass_golden_dir"
_ACCEPT_FROM_OPTION: bool | str = False  # set by pytest_configure from the two accept options
_SAFE = re.compile(r"[^A-Za-z0-9_.\-]+")


@dataclass
class GoldenResult:
    """What :func:`golden_check` did: the files, whether it wrote them, and why the exact check was
    skipped (``exact_skipped``: another torch release recorded it; None when it was checked)."""

    name: str
    text_path: Path
    summary_path: Path
    accepted: bool | str  # True, or "release" (this torch release's exact golden recorded)
    exact_skipped: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)


def golden_paths(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """``(directory/name.txt, directory/name.summary.json)``; the meta sidecar is ``name.meta.json``."""
    if not isinstance(name, str) or not name or _SAFE.sub("", name) != name or name in (".", ".."):
        from .errors import ConfigError

        raise ConfigError("name", name, "a golden name must be a non-empty file name (letters, digits, '_', '.', '-')")
    folder = Path(directory)
    return folder / f"{name}.txt", folder / f"{name}.summary.json"


def _resolve_accept(accept: bool | str | None) -> bool | str:
    from .golden import accept_from_env, accept_mode

    return accept_mode(accept) if accept is not None else (_ACCEPT_FROM_OPTION or accept_from_env())


def _option_accept(config: Any) -> bool | str:
    from .golden import RELEASE

    if config.getoption(ACCEPT_RELEASE_OPTION, default=False):
        return RELEASE
    return bool(config.getoption(ACCEPT_OPTION, default=False))


def _compile_and_run(
    model: Any,
    inputs: Sequence[Any],
    then: Any,
    options: dict[str, Any] | None,
    capture: Sequence[str] | None,
    grad: bool,
) -> list:
    """Compile ``model`` with a fresh graphpass backend (Dynamo reset first, so no cached graph from
    an earlier compile hides this one), run it once on ``inputs`` and return its graph records."""
    import tempfile

    import torch

    from .dynamo_backend import GraphpassBackend

    torch._dynamo.reset()
    gp = GraphpassBackend({"then": then, **(options or {})})
    compiled = torch.compile(model, backend=gp)
    with tempfile.TemporaryDirectory(prefix="graphpass-golden-") as tmp:
        keep = None
        if capture:
            from .capturing import ModelCapture

            keep = ModelCapture(compiled, modules=list(capture), capture_dir=tmp)
        with torch.set_grad_enabled(grad):
            compiled(*inputs)
        del keep
    torch._dynamo.reset()
    if not gp.graphs:
        from .errors import GraphpassError

        raise GraphpassError("graphpass compiled no graph for this model: nothing to compare with a golden")
    return list(gp.graphs)


def check_goldens(
    exact: dict[Path, str],
    summaries: dict[Path, dict[str, Any]],
    *,
    accept: bool | str | None = None,
    hint: str | None = None,
    skip: bool = True,
) -> list[str]:
    """Check (or, accepting, write) structural summaries first, then exact renderings; returns the
    reasons exact checks were skipped (another torch release recorded them). With ``skip`` and under
    pytest, a skipped exact check skips the test once everything else passed."""
    from .golden import ACCEPT_HINT, check_exact, check_summary

    accept = _resolve_accept(accept)
    hint = hint or ACCEPT_HINT
    for path, summary in summaries.items():
        check_summary(path, summary, accept=accept, hint=hint)
    skipped = [why for path, text in exact.items() if (why := check_exact(path, text, accept=accept, hint=hint))]
    if skipped and skip and os.environ.get("PYTEST_CURRENT_TEST"):
        import pytest

        pytest.skip("; ".join(skipped))
    return skipped


def golden_check(
    model: Any,
    *inputs: Any,
    name: str,
    directory: str | os.PathLike,
    accept: bool | str | None = None,
    then: Any = "eager",
    options: dict[str, Any] | None = None,
    capture: Sequence[str] | None = None,
    grad: bool = False,
    hint: str | None = None,
) -> GoldenResult:
    """:func:`assert_golden` without pytest: returns a :class:`GoldenResult` instead of skipping.
    Raises :class:`graphpass.golden.GoldenMismatch` (an ``AssertionError``) with a unified diff."""
    from .golden import render_model, summarize

    text_path, summary_path = golden_paths(directory, name)
    graphs = _compile_and_run(model, inputs, then, options, capture, grad)
    summary = summarize(graphs)
    accept = _resolve_accept(accept)
    skipped = check_goldens(
        {text_path: render_model(graphs)}, {summary_path: summary}, accept=accept, hint=hint, skip=False
    )
    return GoldenResult(name, text_path, summary_path, accept, skipped[0] if skipped else None, summary)


def assert_golden(
    model: Any,
    *inputs: Any,
    name: str,
    directory: str | os.PathLike,
    accept: bool | str | None = None,
    then: Any = "eager",
    options: dict[str, Any] | None = None,
    capture: Sequence[str] | None = None,
    grad: bool = False,
) -> GoldenResult:
    """Compile ``model`` with graphpass (delegate ``then``, default eager; ``options`` as for
    ``graphpass.backend``), run it once on ``inputs`` (under no_grad unless ``grad``) and compare
    its graphs with the goldens ``directory/name.*``.

    ``capture``: module patterns for a ``ModelCapture`` (a ``ModelCapture`` you attached to the
    model yourself is picked up too); an offloaded model (``graphpass.offload``) shows its schedule.
    ``accept``: write the goldens instead of checking them; ``"release"``: record this torch release's
    exact golden beside the main one (:func:`graphpass.golden.accept_release`); None: the pytest options
    ``--graphpass-accept-golden`` / ``--graphpass-accept-golden-release`` or ``GRAPHPASS_ACCEPT_GOLDEN``. The structural summary is always checked; the exact rendering
    only on the torch release it was recorded with, otherwise the test is skipped (under pytest,
    after the summary passed) with a message saying so.
    """
    result = golden_check(
        model,
        *inputs,
        name=name,
        directory=directory,
        accept=accept,
        then=then,
        options=options,
        capture=capture,
        grad=grad,
    )
    if result.exact_skipped and os.environ.get("PYTEST_CURRENT_TEST"):
        import pytest

        pytest.skip(result.exact_skipped)
    return result


# --- the pytest plugin --------------------------------------------------------------------------


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("graphpass")
    group.addoption(
        ACCEPT_OPTION,
        action="store_true",
        default=False,
        help="graphpass golden graphs: write the goldens instead of comparing (same as GRAPHPASS_ACCEPT_GOLDEN=1)",
    )
    group.addoption(
        ACCEPT_RELEASE_OPTION,
        action="store_true",
        default=False,
        help="graphpass golden graphs: record this torch release's exact goldens beside the main ones, "
        "NAME.torch<major.minor>.txt where they differ (same as GRAPHPASS_ACCEPT_GOLDEN=release)",
    )
    parser.addini(
        DIR_INI,
        "graphpass golden graphs: folder of the goldens, relative to the rootdir "
        "(default: a 'golden' folder beside each test file)",
        default="",
    )


def pytest_configure(config: Any) -> None:
    global _ACCEPT_FROM_OPTION
    _ACCEPT_FROM_OPTION = _option_accept(config)


def pytest_unconfigure(config: Any) -> None:
    global _ACCEPT_FROM_OPTION
    _ACCEPT_FROM_OPTION = False


class GoldenFixture:
    """The ``graphpass_golden`` fixture: ``graphpass_golden(model, *inputs, name=None, **kw)`` is
    :func:`assert_golden` with ``name`` defaulting to the test's name and ``directory`` to the
    ``graphpass_golden_dir`` ini option or ``golden/`` beside the test file."""

    def __init__(self, directory: Path, default_name: str, accept: bool | str) -> None:
        self.directory, self.default_name, self.accept = directory, default_name, accept

    def __call__(self, model: Any, *inputs: Any, name: str | None = None, **kwargs: Any) -> GoldenResult:
        kwargs.setdefault("accept", self.accept or None)
        kwargs.setdefault("directory", self.directory)
        return assert_golden(model, *inputs, name=name or self.default_name, **kwargs)


def _golden_dir(config: Any, test_path: Path) -> Path:
    ini = config.getini(DIR_INI)
    return Path(config.rootpath) / ini if ini else Path(test_path).parent / "golden"


def _plain_name(item: Any) -> str:
    """The name a test's goldens had before class names were part of it: the test's own name."""
    return _SAFE.sub("_", item.name).strip("_.") or "golden"


def golden_name(item: Any) -> str:
    """The default golden name of a pytest item: its name (``test_x``, ``test_x_param_``) for a
    module-level test, ``Class.test_x`` (``Outer.Inner.test_x``) for a test in a class, so two
    classes with a method of the same name never share a golden."""
    classes = item.nodeid.split("::")[1:-1]
    return _SAFE.sub("_", ".".join([*classes, item.name])).strip("_.") or "golden"


def _default_name(request: Any, directory: Path, accept: bool) -> str:
    """:func:`golden_name`; for a test in a class whose goldens were recorded under its plain name
    (before class names were part of it), that plain name, as long as nothing else in the test's
    module has that name (one class with that method, no function): existing goldens stay valid
    until re-accepted. Decided from the module, not from the tests selected (``-k``)."""
    name, plain = golden_name(request.node), _plain_name(request.node)
    if (
        name == plain
        or accept
        or golden_paths(directory, name)[1].exists()
        or not golden_paths(directory, plain)[1].exists()
    ):
        return name
    method = request.function.__name__
    module = vars(request.module)
    sharing = sum(isinstance(v, type) and method in vars(v) for v in module.values()) + callable(module.get(method))
    return plain if sharing <= 1 else name


def _fixture(request: Any) -> GoldenFixture:
    directory = _golden_dir(request.config, request.path)
    accept = _option_accept(request.config)
    return GoldenFixture(directory, _default_name(request, directory, bool(accept or _resolve_accept(None))), accept)


try:  # the fixture exists only where pytest does; assert_golden and golden_check work without it
    import pytest as _pytest
except ImportError:  # pragma: no cover
    pass
else:
    graphpass_golden = _pytest.fixture(name="graphpass_golden")(_fixture)
