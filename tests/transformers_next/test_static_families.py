"""The static family sweep against the newest transformers on the index (issue 38, item 2): the leg
``make test-transformers-next`` (``.ci/transformers-next-leg``) installs it beside the main venv's pinned one and runs
this module, so a release that changes what the padding proof relies on is caught before users meet it.

Each family below buckets on the pinned release (docs/conformance.md, the static column); here it must still bucket:
the conformance harness's static column (its tiny config, lengths 5 to 14, buckets 8 and 16, the logits equal to
eager's) must say ``pass (bucketed)``. A family that stops bucketing fails with the proof's reason, which names the
function that changed (``padding_proof`` says so when a pinned function's source differs from the proven one).

Outside that leg (``GRAPHPASS_TRANSFORMERS_NEXT`` unset) the module is skipped: the main leg's conformance run covers
the pinned release.
"""

import os

import pytest

if os.environ.get("GRAPHPASS_TRANSFORMERS_NEXT") != "1":
    pytest.skip(
        "run by make test-transformers-next (the newest transformers beside the pinned one)", allow_module_level=True
    )

transformers = pytest.importorskip("transformers")

from helpers import bench_conformance  # noqa: E402

conformance = bench_conformance()

# state-space and linear-attention families (every chunked scan and selective scan the proof trusts), and dense ones
FAMILIES = [
    "mamba",
    "falcon_mamba",
    "mamba2",
    "jamba",
    "bamba",
    "falcon_h1",
    "zamba2",
    "granitemoehybrid",
    "nemotron_h",
    "qwen3_next",
    "llama",
    "qwen3",
    "gemma2",
    "mistral",
]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_still_buckets(family):
    res = conformance.check_arch(family, "eager", ["static"])
    if res.get("na"):
        pytest.fail(f"{family} does not build on transformers {transformers.__version__}: {res['na']}")
    cell = res["cells"].get("static", "")
    assert cell == "pass (bucketed)", (
        f"transformers {transformers.__version__}: {family}'s static column is {cell!r}: {res['info'].get('static')}"
    )
