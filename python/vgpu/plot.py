"""One figure of a run: share vs cap per tenant over time (top), memory vs limit (bottom). matplotlib, Agg only.

    vgpu.plot.plot(trace, report, "run.png")

Top: each tenant's share (%) per sample period (thin) and per window (steps), its cap a dashed line of the same
colour, the judged region (settle .. end) shaded. Bottom: each tenant's device memory (GiB; one line per device
for a tenant on several) and its limit dashed. Title: the scenario, the mode and PASS/FAIL.
"""

from __future__ import annotations

import os

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .trace import Trace

GIB = 1024 ** 3


def plot(trace: Trace, report=None, path: str | os.PathLike[str] | None = None, dpi: int = 110) -> Figure:
    """Draws the run; saves a PNG at `path` when given. `report` (vgpu.analysis.Report) adds the verdict."""
    figure = Figure(figsize=(11, 7.5), layout="constrained")
    FigureCanvasAgg(figure)
    share_axes, memory_axes = figure.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    colours = [f"C{i % 10}" for i in range(len(trace.tenants))]
    duration_s = trace.duration_ns / 1e9

    samples = trace.sample_shares()
    windows = trace.window_shares()
    if trace.settle_ns < trace.duration_ns:
        share_axes.axvspan(trace.settle_ns / 1e9, duration_s, color="0.92", zorder=0, label="judged")
    top = 100.0
    for index, tenant in enumerate(trace.tenants):
        colour = colours[index]
        name = tenant["tenant"]
        mine = samples[samples["tenant_index"] == index] if len(samples) else samples
        if len(mine):
            share_axes.plot(mine["end_ns"] / 1e9, mine["share_percent"], color=colour, linewidth=0.8, alpha=0.45)
            top = max(top, float(mine["share_percent"].max()))
        per_window = windows[windows["tenant_index"] == index] if len(windows) else windows
        if len(per_window):
            xs = list(per_window["start_ns"] / 1e9) + [float(per_window["end_ns"].iloc[-1]) / 1e9]
            ys = list(per_window["share_percent"]) + [float(per_window["share_percent"].iloc[-1])]
            share_axes.step(xs, ys, where="post", color=colour, linewidth=2.0, label=f"{name} (per window)")
        cores = float(tenant.get("cores_percent", 0) or 0)
        if 0 < cores < 100:
            share_axes.axhline(cores, color=colour, linestyle="--", linewidth=1.2, zorder=3,
                               label=f"{name} cap {cores:g} %")
    share_axes.set_ylabel("share of GPU time (%)")
    share_axes.set_ylim(0, top * 1.05)
    share_axes.set_xlim(0, duration_s if duration_s > 0 else None)
    share_axes.grid(True, alpha=0.3)
    share_axes.legend(loc="best", fontsize="small", ncols=2)

    frame = trace.samples_frame()
    for index, tenant in enumerate(trace.tenants):
        colour = colours[index]
        name = tenant["tenant"]
        mine = frame[frame["tenant_index"] == index] if len(frame) else frame
        devices = sorted(set(int(d) for d in mine["device"])) if len(mine) else []
        for device in devices:
            rows = mine[mine["device"] == device]
            label = name if len(devices) == 1 else f"{name} device {device}"
            memory_axes.plot(rows["t_ns"] / 1e9, rows["memory_bytes"] / GIB, color=colour, linewidth=1.5,
                             label=label)
        limit = int(tenant.get("memory_limit_bytes", 0) or 0)
        if limit:
            memory_axes.axhline(limit / GIB, color=colour, linestyle="--", linewidth=1.2, zorder=3,
                                label=f"{name} limit {limit / GIB:g} GiB")
    memory_axes.set_ylabel("device memory (GiB)")
    memory_axes.set_xlabel("time since the run's start (s)")
    memory_axes.set_ylim(bottom=0)
    memory_axes.grid(True, alpha=0.3)
    if memory_axes.get_legend_handles_labels()[0]:
        memory_axes.legend(loc="best", fontsize="small", ncols=2)

    title = f"{trace.run.get('scenario', '?')} — {trace.mode or '?'} mode"
    if report is not None:
        title += f" — {'PASS' if report.passed else 'FAIL'}"
        if report.fairness is not None:
            title += f" (fairness {report.fairness:.3f})"
    figure.suptitle(title)
    if path is not None:
        figure.savefig(os.fspath(path), dpi=dpi, format="png")
    return figure


__all__ = ["plot"]
