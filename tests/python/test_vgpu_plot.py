"""vgpu.plot on a synthetic trace: one PNG, share vs cap on top, memory vs limit below."""

from __future__ import annotations

from vgpu_fixtures import GIB, TraceWriter

from vgpu.analysis import summarize
from vgpu.plot import plot
from vgpu.trace import parse_trace

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_plot_writes_a_png_with_caps_limits_and_the_verdict(tmp_path):
    writer = TraceWriter().tenant("a", cores=30, memory_limit=4 * GIB).tenant("b", cores=70)
    writer.process("a").process("b")
    writer.window_shares("a", [10, 20, 31, 29, 30, 32], memory_bytes=[GIB] * 30 + [3 * GIB] * 30)
    writer.window_shares("b", [90, 80, 69, 71, 70, 68], memory_bytes=2 * GIB).end()
    trace = parse_trace(writer.text())
    report = summarize(trace)
    path = tmp_path / "run.png"
    figure = plot(trace, report, path)

    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 20_000
    share_axes, memory_axes = figure.axes
    assert share_axes.get_ylabel() == "share of GPU time (%)"
    dashed = [line for line in share_axes.get_lines() if line.get_linestyle() == "--"]
    assert sorted(line.get_ydata()[0] for line in dashed) == [30, 70]
    # Each cap has its tenant's colour.
    steps = {line.get_label(): line.get_color() for line in share_axes.get_lines()}
    assert steps["a (per window)"] == steps["a cap 30 %"] and steps["b (per window)"] == steps["b cap 70 %"]
    assert len(share_axes.patches) == 1                  # the judged region
    limits = [line for line in memory_axes.get_lines() if line.get_linestyle() == "--"]
    assert [line.get_ydata()[0] for line in limits] == [4.0]
    assert figure.get_suptitle() == "synthetic — virtual mode — PASS (fairness 0.999)"


def test_plot_without_a_report_or_samples(tmp_path):
    writer = TraceWriter().tenant("a")
    figure = plot(parse_trace(writer.text()), path=tmp_path / "empty.png")
    assert (tmp_path / "empty.png").read_bytes().startswith(PNG_SIGNATURE)
    assert "PASS" not in figure.get_suptitle()
