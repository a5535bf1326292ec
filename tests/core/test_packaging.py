"""The built wheel, installed on its own, is a complete graphpass.

Builds the wheel from ``pyproject.toml`` (from a copy of the checkout, so no ``build/`` or
``*.egg-info`` is written into it and no stale build output can leak into the wheel), installs it
into a fresh virtual environment and imports it there. The environment sees torch and the other
dependencies through a ``.pth`` line naming the directories they live in; a ``.pth`` line adds a
directory but does not run the ``.pth`` files inside it, so the editable install's finder (which
maps ``graphpass`` to this checkout) is never installed and only the wheel's files can be imported.

Build isolation would need the network to fetch setuptools, so the build runs with
``--no-build-isolation`` and uses the build backend installed next to the test run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUBPACKAGES = (
    "graphpass.passes",
    "graphpass.offloading",
    "graphpass.capturing",
    "graphpass.static_shapes",
    "graphpass.models",
    "graphpass.backends",
)
# What not to copy into the build tree: VCS data, environments, build output, caches, run output.
_IGNORE = shutil.ignore_patterns(
    ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "*.pyc", "captures", "out"
)


def _repo_sources() -> list[str]:
    """Every .py of the package in the checkout, as its path inside the wheel."""
    names = [p.relative_to(REPO).as_posix() for p in (REPO / "graphpass").rglob("*.py")]
    names += [
        "graphpass/backends/" + p.relative_to(REPO / "backends").as_posix() for p in (REPO / "backends").rglob("*.py")
    ]
    names += ["graphpass_vllm_plugin.py"]  # the vLLM plugin's entry point, a top-level module (pyproject py-modules)
    return sorted(n for n in names if "__pycache__" not in n)


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip(
            "the build backend (setuptools, pyproject's build-system) is not installed in this environment; "
            "the wheel cannot be built without build isolation, and isolation needs the network"
        )
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=_IGNORE, symlinks=True)
    out = tmp / "dist"
    # pyproject's build-system also lists "wheel": setuptools >= 70.1 builds wheels itself, so the
    # package need not be installed here (pip does not check build requirements without isolation).
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        cwd=tmp,
    )
    (whl,) = out.glob("graphpass-*.whl")
    return whl


def test_wheel_holds_every_source_file(wheel):
    with zipfile.ZipFile(wheel) as zf:
        files = set(zf.namelist())
    missing = [n for n in _repo_sources() if n not in files]
    assert not missing, (
        f"in the checkout but not in the wheel (add the package to [tool.setuptools] packages): {missing}"
    )
    stray = sorted(n for n in files if n.endswith(".py") and n not in set(_repo_sources()))
    assert not stray, f"in the wheel but not in the checkout: {stray}"
    (entry_points,) = [n for n in files if n.endswith(".dist-info/entry_points.txt")]
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(entry_points).decode()
    assert "[torch_dynamo_backends]" in text and "graphpass = graphpass.dynamo_backend:graphpass_backend" in text
    assert "[console_scripts]" in text and "graphpass = graphpass.cli:main" in text
    assert "[vllm.general_plugins]" in text and "graphpass = graphpass_vllm_plugin:register" in text


_CHECK = textwrap.dedent(
    """
    import importlib, importlib.metadata, json, pkgutil, sys, types
    site, subpackages = sys.argv[1], json.loads(sys.argv[2])

    import graphpass
    assert site.endswith("/")
    assert graphpass.__file__.startswith(site), f"graphpass imported from {graphpass.__file__}, not the wheel"

    for name in subpackages:
        mod = importlib.import_module(name)
        assert mod.__file__.startswith(site), f"{name} imported from {mod.__file__}"
    # every module of the wheel imports (and, imported, sets its name on its package)
    for info in pkgutil.walk_packages(graphpass.__path__, "graphpass."):
        if info.name != "graphpass.__main__":  # running it is the command line
            importlib.import_module(info.name)
    outside = sorted(n for n, m in sys.modules.items() if n.split(".")[0] == "graphpass"
                     and not (getattr(m, "__file__", None) or site).startswith(site))
    assert not outside, f"imported from outside the wheel: {outside}"

    # every public name, and none of them shadowed by a submodule of the same name
    namespace = {}
    exec("from graphpass import *", namespace)
    for name in graphpass.__all__:
        assert name in namespace, name
        obj = getattr(graphpass, name)
        assert not isinstance(obj, types.ModuleType), f"graphpass.{name} is the module {obj.__name__}, not the public object"
        if name != "__version__":
            assert obj is namespace[name], name

    (ep,) = [e for e in importlib.metadata.entry_points(group="torch_dynamo_backends") if e.name == "graphpass"
             and e.dist is not None and (str(e.dist.locate_file("")) + "/").startswith(site)]
    assert ep.load() is graphpass.dynamo_backend.graphpass_backend
    assert importlib.metadata.version("graphpass") == graphpass.__version__
    print("ok", len(graphpass.__all__), "names")
    """
)


def test_installed_wheel_imports_on_its_own(wheel, tmp_path):
    env = tmp_path / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env)])
    python = env / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-compile",
            "--disable-pip-version-check",
            "-q",
            "--target",
            str(site),
            str(wheel),
        ]
    )
    # The dependencies, from wherever this run finds them: directories only, never this checkout.
    deps = {Path(importlib.util.find_spec(m).origin).parents[1] for m in ("torch", "sympy", "tabulate", "safetensors")}
    deps.add(Path(sysconfig.get_path("purelib")))
    assert REPO not in deps
    (site / "zz_graphpass_test_deps.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))

    clean = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    proc = subprocess.run(
        [str(python), "-c", _CHECK, str(site) + "/", json.dumps(SUBPACKAGES)],
        cwd=tmp_path,
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert proc.stdout.startswith("ok")
