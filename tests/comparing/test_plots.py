"""``graphpass compare --plot / --html`` and ``CompareReport.plot`` / ``to_html``: the files' content."""

from __future__ import annotations

import base64
import io
import re
import struct
from pathlib import Path

import pytest

from graphpass.comparing import compare
from graphpass.comparing.plots import (
    PlotUnavailableError,
    figure_pixels,
    html_page,
    plot_report,
    step_series,
    write_html,
)
from graphpass.cli import main
from helpers import no_matplotlib
from test_compare import clone, model_step, write_step

pytest.importorskip("matplotlib")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
URL = re.compile(r"https?://", re.IGNORECASE)


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the IHDR chunk that follows the PNG signature."""
    assert data[:8] == PNG_SIGNATURE
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    return struct.unpack(">II", data[16:24])


def two_runs(root: Path, steps: int = 1, bad_step: int = 0) -> tuple[Path, Path]:
    """ref and test capture folders; in step ``bad_step`` layers.2 diverges (and layers.3 after it)."""
    ref, test = root / "ref", root / "test"
    for k in range(steps):
        step = model_step(seed=k)
        other = clone(step)
        if k == bad_step:
            other["layers.2"][0]["0"][1, 3, 5] += 0.0125
            other["layers.3"][0]["0"] += 1.0
        write_step(ref, f"prefill_s8_{k}", step)
        write_step(test, f"prefill_s8_{k}", other)
    return ref, test


def test_plot_one_step_is_a_png_of_the_expected_size(tmp_path):
    ref, test = two_runs(tmp_path)
    report = compare(ref, test)
    out = report.plot(tmp_path / "out" / "div.png")
    data = out.read_bytes()
    assert png_size(data) == figure_pixels(1) == (600, 320)
    import matplotlib.image

    pixels = matplotlib.image.imread(io.BytesIO(data), format="png")
    assert pixels.shape[:2] == (320, 600)
    assert pixels[..., :3].std() > 0.05  # something is drawn, not a blank canvas


def test_several_steps_are_small_multiples(tmp_path):
    ref, test = two_runs(tmp_path, steps=3, bad_step=1)
    report = compare(ref, test)
    series = step_series(report)
    assert list(series) == ["dp0/prefill_s8_0", "dp0/prefill_s8_1", "dp0/prefill_s8_2"]
    assert [m["module"] for m in series["dp0/prefill_s8_1"]] == [
        "layers.0",
        "layers.1",
        "layers.2",
        "layers.3",
        "lm_head",
    ]
    assert [m["passed"] for m in series["dp0/prefill_s8_1"]] == [True, True, False, False, True]
    assert series["dp0/prefill_s8_0"][0]["rel_linf"] == 0.0
    out = plot_report(report, tmp_path / "multi.png", dpi=50)
    assert png_size(out.read_bytes()) == figure_pixels(3, dpi=50) == (600, 320)  # 2 columns x 2 rows
    assert figure_pixels(4) == (1200, 640) and figure_pixels(5) == (1200, 960)


def test_plot_draws_rows_without_numbers(tmp_path):
    ref, test = two_runs(tmp_path)
    missing = model_step()
    del missing["layers.1"]
    write_step(test, "prefill_s8_1", missing)
    write_step(ref, "prefill_s8_1", model_step())
    report = compare(ref, test)
    series = step_series(report)["dp0/prefill_s8_1"]
    assert [m for m in series if m["module"] == "layers.1"][0]["rel_linf"] is None
    assert png_size(report.plot(tmp_path / "x.png").read_bytes()) == figure_pixels(2)


def test_html_is_self_contained_and_names_the_first_divergence(tmp_path):
    ref, test = two_runs(tmp_path, steps=2, bad_step=1)
    report = compare(ref, test)
    page = report.to_html(tmp_path / "report.html").read_text(encoding="utf-8")
    assert "first diverging module: <b>layers.2</b>" in page
    assert not URL.search(page), URL.search(page)
    assert "<script" not in page and "<link" not in page
    (b64,) = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert png_size(base64.b64decode(b64)) == figure_pixels(2)
    assert page.count('<tr class="first">') == 1 and page.count('<tr class="fail">') == 1  # layers.2 then layers.3
    assert "<h3>ref: " in page and "<h3>test: " in page and '"torch_version"' in page and '"modules"' in page
    assert page.count("<summary>dp0/prefill_s8_") == 4  # both steps of both runs


def test_html_escapes_names(tmp_path):
    ref, test = two_runs(tmp_path)
    report = compare(ref, test)
    report.notes.append("<b>not markup</b>")
    page = html_page(report, None)
    assert "&lt;b&gt;not markup&lt;/b&gt;" in page and "<b>not markup</b>" not in page
    assert "data:image/png" not in page
    assert "data:image/png" not in write_html(report, tmp_path / "p.html", plot=False).read_text()


def test_cli_plot_and_html(tmp_path, capsys):
    ref, test = two_runs(tmp_path)
    png, page = tmp_path / "out.png", tmp_path / "out.html"
    assert main(["compare", str(ref), str(test), "--plot", str(png), "--html", str(page)]) == 1
    out = capsys.readouterr().out
    assert f"plot written to {png}" in out and f"page written to {page}" in out
    assert png_size(png.read_bytes()) == figure_pixels(1)
    text = page.read_text()
    assert "layers.2" in text and not URL.search(text)


def test_missing_matplotlib_is_a_clear_graphpass_error(tmp_path, monkeypatch, capsys):
    ref, test = two_runs(tmp_path)
    report = compare(ref, test)
    no_matplotlib(monkeypatch)
    with pytest.raises(PlotUnavailableError, match=re.escape("pip install 'graphpass[plot]'")):
        report.plot(tmp_path / "x.png")
    with pytest.raises(PlotUnavailableError):
        report.to_html(tmp_path / "x.html")
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "x.html").exists()
    write_html(report, tmp_path / "bare.html", plot=False)  # the page without a plot needs no matplotlib
    assert main(["compare", str(ref), str(test), "--plot", str(tmp_path / "y.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphpass: error: ") and "pip install 'graphpass[plot]'" in err
