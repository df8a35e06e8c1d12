"""Achieved share against the cap, per workload, from a GPU suite report (and the kernel-time probe's records, where
given): the figure of deliverable 7 of issue 6, docs/results-gpu.md.

  python3 tests/gpu/plot_caps.py REPORT_JSON [--kernel-time KERNEL_TIME_JSONL] --out caps.png

Left: what each workload achieved at each cap, the line achieved = cap and its +/- 2 point band. Right: achieved
less the cap, per judged point. Each workload is drawn by every measure the run has for it:

  vgpu-tenant 1 ms         its own busy time (exact: it times its kernels)
  fp32 matmul 2048         throughput, as a fraction of the uncapped run (its clock does not move with the cap)
  5 us kernels, depth 8    throughput, as a fraction of the uncapped run (on the H100 they run back to back
                           uncapped, 7.0 us a kernel: the throughput counts each kernel's dispatch), and their own
                           spin time (5 us a kernel: the dispatch left out; over fakecuda the two agree)
  two vgpu-tenants         their own busy time, side by side (30/70 books the GPU to the full)
  PyTorch, with the probe  the kernels' own time from CUPTI (--kernel-time: the dispatch left out) and NVML's
                           utilization from 1 s into the run (the dispatch counted)
  PyTorch, in the report   NVML's utilization from 1 s in, where the report has it (`util_mean_all` beside it);
                           not the bf16 matmul's or x.add_'s throughput (capped, the bf16 matmul runs at a higher
                           clock than uncapped; x.add_'s launch rate follows the host's)

Which of "dispatch counted" and "dispatch left out" a cap promises for kernels of a few microseconds is open
(docs/compute-limit.md, "What the share is"); for kernels of a few hundred microseconds they agree.

A cap above what the workload uses uncapped (by more than the band) does not bind: such a point is drawn grey on the
left and is not judged, unless it reads over the cap (x.add_ is launch-bound at ~13 % of the GPU's time uncapped, and
its launch rate follows the host's: 60-86 thousand a second in one session). Prints the points as a table; writes
the PNG with matplotlib (Agg). Exit 2 on bad input, naming the file, the entry, the value and what is accepted.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field

BAND_POINTS = 2.0  # issue 6's target: within 2 points of the cap
NVML_FROM_1S = "NVML utilization, from 1 s in"


@dataclass
class Series:
    label: str
    measure: str
    # (cap, achieved, judged): percent; judged False where the cap does not bind and is not exceeded
    points: list[tuple[float, float, bool]] = field(default_factory=list)
    side_by_side: bool = False


class BadInput(ValueError):
    """Input that is not what the suite writes: the message names the file, the value and what is accepted."""


def _is_cap(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 100


def read_report(path: str) -> dict:
    try:
        with open(path) as source:
            report = json.load(source)
    except OSError as error:
        raise BadInput(f"{path}: cannot be read ({error.strerror}); expected a report.json of tests/gpu/run.sh") from None
    except json.JSONDecodeError as error:
        raise BadInput(f"{path}: not JSON ({error.msg} at line {error.lineno}); expected a report.json of "
                       "tests/gpu/run.sh") from None
    stages = report.get("stages") if isinstance(report, dict) else None
    compute = stages.get("compute") if isinstance(stages, dict) else None
    if not isinstance(compute, dict) or not isinstance(compute.get("caps"), list):
        names = sorted(stages) if isinstance(stages, dict) else []
        raise BadInput(f"{path}: no compute stage with its caps (stages: {', '.join(names) or 'none'}); expected a "
                       "report of a run with VGPU_GPU_STAGES including compute")
    for cap in compute["caps"]:
        if not _is_cap(cap) or cap == 0:
            raise BadInput(f"{path}: compute caps {compute['caps']!r}: {cap!r} is not a cap; expected whole percents "
                           "from 1 to 100, as VGPU_GPU_CAPS=10,30,50 gives")
    return report


def read_kernel_time(path: str) -> list[dict]:
    rows = []
    try:
        with open(path) as source:
            for number, line in enumerate(source, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise BadInput(f"{path}:{number}: not a JSON line; expected the lines of tests/gpu/kernel_time.sh "
                                   "(kernel-time.jsonl)") from None
                if not isinstance(row, dict) or "cap" not in row or "which" not in row:
                    raise BadInput(f"{path}:{number}: a line without 'which' and 'cap'; expected the lines of "
                                   "tests/gpu/kernel_time.sh (kernel-time.jsonl)")
                if not _is_cap(row["cap"]) or not isinstance(row["which"], str):
                    raise BadInput(f"{path}:{number}: cap {row['cap']!r}, which {row['which']!r}; expected a cap of 0 "
                                   "(no shim) to 100 and a workload name (add, mm8192, mm2048)")
                row["_where"] = f"{path}:{number}"
                rows.append(row)
    except OSError as error:
        raise BadInput(f"{path}: cannot be read ({error.strerror}); expected kernel-time.jsonl of "
                       "tests/gpu/kernel_time.sh") from None
    return rows


def _dict(value) -> dict:
    """An entry of the report, or nothing where a stage cut short left null, a string or no entry."""
    return value if isinstance(value, dict) else {}


# What a measured value may be: fractions of the GPU's time up to a little over 1 (a run's own clock against the
# span), of the uncapped throughput up to 10 (a launch-bound workload's rate moves with the host's), percents to 100.
RANGES = {"busy_fraction": (0.0, 1.1), "fraction_of_uncapped": (0.0, 10.0), "util_mean": (0.0, 100.0),
          "nvml_util_mean_after_1s": (0.0, 100.0)}


def _value(entry: dict, key: str, where: str) -> float | None:
    """entry[key] as a number within RANGES[key]; None where it is missing or null (not measured)."""
    value = entry.get(key)
    if value is None:
        return None
    low, high = RANGES[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            not low <= value <= high:
        raise BadInput(f"{where}: {key} {value!r}; expected a number from {low:g} to {high:g} (or null: not measured)")
    return float(value)


def _percent_of(key: str):
    scale = 1.0 if key in ("util_mean", "nvml_util_mean_after_1s") else 100.0
    return lambda entry, where: None if (v := _value(entry, key, where)) is None else scale * v


def _point(cap: float, achieved: float, uncapped: float | None) -> tuple[float, float, bool]:
    """Judged unless the workload uses less than the cap uncapped (by more than the band) and stays under it."""
    binds = uncapped is None or uncapped >= cap - BAND_POINTS
    return cap, achieved, binds or achieved > cap + BAND_POINTS


def _by_cap(points: dict, caps, read, where: str, series: Series, uncapped_too: bool = True) -> Series:
    base = read(_dict(points.get("0")), f"{where}.0") if uncapped_too else None
    for cap in caps:
        achieved = read(_dict(points.get(str(cap))), f"{where}.{cap}")
        if achieved is not None:
            series.points.append(_point(float(cap), achieved, base))
    return series


def series_of(report: dict, kernel_time: list[dict] | None = None, source: str = "report") -> list[Series]:
    """Every workload's points, by every measure the run has for it. Pure: no plotting. `source` names the report
    in errors."""
    compute = _dict(_dict(report.get("stages")).get("compute"))
    where = f"{source}: stages.compute"
    caps = [int(c) for c in compute.get("caps") or []]
    torch = _dict(compute.get("torch"))
    out: list[Series] = []

    out.append(_by_cap(_dict(compute.get("tenant")), caps, _percent_of("busy_fraction"), f"{where}.tenant",
                       Series("vgpu-tenant 1 ms", "busy time")))
    out.append(_by_cap(_dict(torch.get("mm2048")), caps, _percent_of("fraction_of_uncapped"), f"{where}.torch.mm2048",
                       Series("fp32 matmul 2048", "% of uncapped throughput"), uncapped_too=False))
    small = _dict(compute.get("tenant_5us"))
    for key, measure in (("fraction_of_uncapped", "% of uncapped throughput"),
                         ("busy_fraction", "own spin time, dispatch left out")):
        achieved = _percent_of(key)(_dict(small.get("30")), f"{where}.tenant_5us.30")
        if achieved is not None:
            out.append(Series("5 us kernels, depth 8", measure, [_point(30.0, achieved, None)]))
    for key, name in (("mm8192", "bf16 matmul 8192"), ("add", "x.add_ 1M")):
        points = _dict(torch.get(key))
        # Only where the suite left out NVML's samples from before the span (util_mean_all beside util_mean).
        if points and all("util_mean_all" in _dict(e) for e in points.values()):
            out.append(_by_cap(points, caps, _percent_of("util_mean"), f"{where}.torch.{key}",
                               Series(name, NVML_FROM_1S)))
    for key in ("pair_tenant", "pair_tenant_30_60"):
        pair = _dict(compute.get(key))
        shares = sorted((int(cap), _dict(e)) for cap, e in pair.items() if cap.isdigit())
        series = Series("pair " + "/".join(str(cap) for cap, _ in shares), "busy time, side by side",
                        side_by_side=True)
        for cap, entry in shares:
            achieved = _percent_of("busy_fraction")(entry, f"{where}.{key}.{cap}")
            if achieved is not None:
                series.points.append(_point(float(cap), achieved, None))
        out.append(series)

    names = {"add": "x.add_ 1M", "mm8192": "bf16 matmul 8192", "mm2048": "fp32 matmul 2048"}
    measures = (("CUPTI kernel time, dispatch left out", _percent_of("busy_fraction")),
                (NVML_FROM_1S, _percent_of("nvml_util_mean_after_1s")))
    rows = [r for r in kernel_time or [] if r.get("rc") == 0]
    for which in sorted({r["which"] for r in rows}):
        for measure, read in measures:
            # The runs of one cap are averaged (uncapped ones are often repeated: the host's launch rate moves).
            by_cap: dict[int, list[float]] = {}
            for row in rows:
                if row["which"] == which and (value := read(row, row.get("_where", "kernel-time"))) is not None:
                    by_cap.setdefault(int(row["cap"]), []).append(value)
            uncapped = by_cap.pop(0, None)
            base = sum(uncapped) / len(uncapped) if uncapped else None
            series = Series(names.get(which, which), measure)
            for cap, values in sorted(by_cap.items()):
                series.points.append(_point(float(cap), sum(values) / len(values), base))
            out.append(series)
    return [s for s in out if s.points]


def table(series: list[Series]) -> str:
    lines = [f"{'workload':<24} {'measure':<38} {'cap':>4} {'achieved':>9} {'off':>7}  within 2"]
    for s in series:
        for cap, achieved, judged in s.points:
            if judged:
                off = f"{achieved - cap:>+7.2f}"
                verdict = "yes" if abs(achieved - cap) <= BAND_POINTS else "NO"
            else:
                off, verdict = f"{'-':>7}", "not judged: the cap is above the uncapped use"
            lines.append(f"{s.label:<24} {s.measure:<38} {cap:>4.0f} {achieved:>9.2f} {off}  {verdict}")
    return "\n".join(lines)


def plot(series: list[Series], path: str, title: str):
    """Draws the two panels and saves the PNG at `path`; returns the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(13, 6.5), layout="constrained")
    FigureCanvasAgg(figure)
    achieved_axes, off_axes = figure.subplots(1, 2, width_ratios=[1, 1.15])
    line = [0, 100]
    achieved_axes.plot(line, line, color="0.4", linestyle="--", linewidth=1, label="achieved = cap")
    achieved_axes.fill_between(line, [v - BAND_POINTS for v in line], [v + BAND_POINTS for v in line], color="0.88",
                               zorder=0, label=f"± {BAND_POINTS:g} points")
    off_axes.axhspan(-BAND_POINTS, BAND_POINTS, color="0.88", zorder=0)
    off_axes.axhline(0, color="0.4", linestyle="--", linewidth=1)
    markers = "osD^vP*Xh<>"
    # matplotlib's ten colours less its grey (grey is for points not judged), then others.
    colours = ["C0", "C1", "C2", "C3", "C4", "C5", "C6", "C8", "C9", "#1b9e77", "#7570b3", "#e7298a", "#66a61e"]
    offs_all = [0.0]
    free_drawn = False
    for index, s in enumerate(series):
        colour, marker = colours[index % len(colours)], markers[index % len(markers)]
        judged = [p for p in s.points if p[2]]
        free = [p for p in s.points if not p[2]]
        # Hollow: two containers side by side. Grey: the cap does not bind (not judged).
        style = {"color": colour, "marker": marker, "markersize": 7,
                 "markerfacecolor": "none" if s.side_by_side else colour}
        label = f"{s.label} ({s.measure})"
        achieved_axes.plot([p[0] for p in judged], [p[1] for p in judged], linestyle="none", label=label, **style)
        if free:
            achieved_axes.plot([p[0] for p in free], [p[1] for p in free], linestyle="none", marker=marker,
                               markersize=6, color="0.6", markerfacecolor="0.85",
                               label=None if free_drawn else "grey: the cap is above the uncapped use, not judged")
            free_drawn = True
        # Points of one workload spread a little sideways on the right, so that equal caps do not hide each other.
        nudge = (index - (len(series) - 1) / 2) * 0.4
        offs = [p[1] - p[0] for p in judged]
        offs_all += offs
        off_axes.plot([p[0] + nudge for p in judged], offs, linewidth=0.8,
                      linestyle="none" if s.side_by_side or len(judged) < 2 else "-", **style)
    achieved_axes.set(xlim=(0, 100), ylim=(0, max(100.0, *(p[1] + 3 for s in series for p in s.points))),
                      xlabel="cap (%)", ylabel="achieved (%)", title="achieved against the cap (hollow: side by side)")
    off_axes.set(xlim=(0, 100), ylim=(min(-4.0, min(offs_all) - 1.0), max(4.0, max(offs_all) + 1.0)),
                 xlabel="cap (%)", ylabel="achieved − cap (points)", title="off the cap, the judged points")
    for axes in (achieved_axes, off_axes):
        axes.grid(True, alpha=0.3)
    achieved_axes.legend(loc="upper left", fontsize="x-small")
    figure.suptitle(title)
    figure.savefig(path, dpi=110)
    return figure


def describe(report: dict) -> str:
    env = _dict(report.get("env"))
    compute = _dict(_dict(report.get("stages")).get("compute"))
    gpu = env.get("gpu_name") or env.get("gpu") or "GPU"
    parts = [str(gpu), f"driver {env['driver']}" if env.get("driver") else None,
             f"commit {env['commit']}" if env.get("commit") else None, report.get("started")]
    return f"compute caps, policy {compute.get('policy') or '?'}: " + ", ".join(str(p) for p in parts if p)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="report.json of tests/gpu/run.sh (with the compute stage)")
    parser.add_argument("--kernel-time", help="kernel-time.jsonl of tests/gpu/kernel_time.sh")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    try:
        report = read_report(args.report)
        series = series_of(report, read_kernel_time(args.kernel_time) if args.kernel_time else None, args.report)
    except BadInput as error:
        print(f"plot_caps: {error}", file=sys.stderr)
        return 2
    if not series:
        print(f"plot_caps: {args.report}: the compute stage has no measured points (skipped for time?)",
              file=sys.stderr)
        return 2
    print(table(series))
    plot(series, args.out, describe(report))
    print(f"plot_caps: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
