"""Achieved share against the cap, per workload, from a GPU suite report (and the kernel-time probe's records, where
given): the figure of deliverable 7 of issue 6, docs/results-gpu.md.

  python3 tests/gpu/plot_caps.py REPORT_JSON [--kernel-time KERNEL_TIME_JSONL] --out caps.png

Left: what each workload achieved at each cap, the line achieved = cap and its +/- 2 point band. Right: achieved
less what the cap should give, per point. Each workload is judged by the one measure that fits it:

  vgpu-tenant 1 ms         its own busy time (exact: it times its kernels)
  fp32 matmul 2048         throughput, as a fraction of the uncapped run (its clock does not move with the cap)
  5 us kernels, depth 8    throughput, as a fraction of the uncapped run (back to back uncapped on the H100: 7.0 us
                           a kernel, its dispatch included); over fakecuda, its busy time
  two vgpu-tenants         their own busy time, side by side (30/70 books the GPU to the full)
  bf16 8192, x.add_        the kernels' own time from CUPTI (--kernel-time), and NVML's utilization where the report
                           leaves out the samples that reach back before the span (`util_mean_all` present)

A cap above what the workload uses uncapped (less the 2-point band) does not bind: such a point is drawn on the left,
hollow, and not judged (x.add_ is launch-bound at ~13 % of the GPU's time uncapped, and its launch rate follows the
host's: 60-86 thousand a second in one session). Prints the points as a table; writes the PNG with matplotlib (Agg).
Exit 2 on bad input, naming the file and what was expected.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

BAND_POINTS = 2.0  # issue 6's target: within 2 points of the cap


@dataclass
class Series:
    label: str
    measure: str
    # (cap, achieved, expected), percent; expected None: the cap does not bind (above the uncapped use)
    points: list[tuple[float, float, float | None]] = field(default_factory=list)
    side_by_side: bool = False


class BadInput(ValueError):
    """Input that is not what the suite writes: the message names the file, the value and what is accepted."""


def read_report(path: str) -> dict:
    try:
        with open(path) as source:
            report = json.load(source)
    except OSError as error:
        raise BadInput(f"{path}: cannot be read ({error.strerror}); expected a report.json of tests/gpu/run.sh") from None
    except json.JSONDecodeError as error:
        raise BadInput(f"{path}: not JSON ({error.msg} at line {error.lineno}); expected a report.json of "
                       "tests/gpu/run.sh") from None
    compute = report.get("stages", {}).get("compute") if isinstance(report, dict) else None
    if not isinstance(compute, dict) or not isinstance(compute.get("caps"), list):
        stages = sorted(report.get("stages", {})) if isinstance(report, dict) else []
        raise BadInput(f"{path}: no compute stage with its caps (stages: {', '.join(stages) or 'none'}); expected a "
                       "report of a run with VGPU_GPU_STAGES including compute")
    for cap in compute["caps"]:
        if not _is_cap(cap) or cap == 0:
            raise BadInput(f"{path}: compute caps {compute['caps']!r}: {cap!r} is not a cap; expected whole percents "
                           "from 1 to 100, as VGPU_GPU_CAPS=10,30,50 gives")
    return report


def _is_cap(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 100


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
                rows.append(row)
    except OSError as error:
        raise BadInput(f"{path}: cannot be read ({error.strerror}); expected kernel-time.jsonl of "
                       "tests/gpu/kernel_time.sh") from None
    return rows


def _percent(value) -> float | None:
    return None if value is None else 100.0 * float(value)


def expected_at(cap: float, uncapped: float | None) -> float | None:
    """What a cap should give: the cap, unless the workload uses less than it uncapped (then nothing is judged)."""
    return None if uncapped is not None and uncapped < cap - BAND_POINTS else float(cap)


def _capped(points: dict, caps, read, uncapped: float | None, series: Series) -> Series:
    for cap in caps:
        achieved = read(points.get(str(cap)) or {})
        if achieved is not None:
            series.points.append((float(cap), achieved, expected_at(float(cap), uncapped)))
    return series


def series_of(report: dict, kernel_time: list[dict] | None = None) -> list[Series]:
    """Every workload's points. Pure: no plotting."""
    compute = report["stages"]["compute"]
    caps = [int(c) for c in compute["caps"]]
    torch = compute.get("torch", {})
    out: list[Series] = []

    tenant = compute.get("tenant", {})
    if tenant:
        base = _percent((tenant.get("0") or {}).get("busy_fraction"))
        out.append(_capped(tenant, caps, lambda e: _percent(e.get("busy_fraction")), base,
                           Series("vgpu-tenant 1 ms", "busy time")))
    if "mm2048" in torch:
        out.append(_capped(torch["mm2048"], caps, lambda e: _percent(e.get("fraction_of_uncapped")), None,
                           Series("fp32 matmul 2048", "% of uncapped throughput")))
    small = compute.get("tenant_5us", {}).get("30", {})
    if report.get("fake") and small.get("busy_fraction") is not None:
        # fakecuda runs a kernel for exactly its time and the host cannot keep 5 us kernels back to back there.
        out.append(Series("5 us kernels, depth 8", "busy time", [(30.0, _percent(small["busy_fraction"]), 30.0)]))
    elif small.get("fraction_of_uncapped") is not None:
        # On the H100 they are back to back uncapped (7.0 us each: the spin and its dispatch), so throughput is time.
        out.append(Series("5 us kernels, depth 8", "% of uncapped throughput",
                          [(30.0, _percent(small["fraction_of_uncapped"]), 30.0)]))
    for key, name in (("mm8192", "bf16 matmul 8192"), ("add", "x.add_ 1M")):
        points = torch.get(key, {})
        # Only where the suite left out NVML's samples from before the span (util_mean_all beside util_mean).
        if points and all("util_mean_all" in e for e in points.values()):
            base = (points.get("0") or {}).get("util_mean")
            out.append(_capped(points, caps, lambda e: e.get("util_mean"), base, Series(name, "NVML utilization")))
    for key in ("pair_tenant", "pair_tenant_30_60"):
        pair = compute.get(key)
        if not pair:
            continue
        shares = {cap: e for cap, e in pair.items() if cap.isdigit() and isinstance(e, dict)}
        label = "pair " + "/".join(sorted(shares, key=int))
        out.append(Series(label, "busy time, side by side",
                          [(float(c), _percent(e["busy_fraction"]), float(c))
                           for c, e in sorted(shares.items(), key=lambda item: int(item[0]))
                           if e.get("busy_fraction") is not None], side_by_side=True))

    names = {"add": "x.add_ 1M", "mm8192": "bf16 matmul 8192", "mm2048": "fp32 matmul 2048"}
    measures = (("CUPTI kernel time", lambda r: _percent(r.get("busy_fraction"))),
                ("NVML utilization, from 1 s in", lambda r: r.get("nvml_util_mean_after_1s")))
    for which in sorted({r["which"] for r in kernel_time or [] if r.get("rc") == 0}):
        rows = [r for r in kernel_time if r["which"] == which and r.get("rc") == 0]
        for measure, read in measures:
            # The runs of one cap are averaged (uncapped ones are often repeated: the host's launch rate moves).
            by_cap: dict[int, list[float]] = {}
            for row in rows:
                if read(row) is not None:
                    by_cap.setdefault(int(row["cap"]), []).append(float(read(row)))
            uncapped = by_cap.pop(0, None)
            base = sum(uncapped) / len(uncapped) if uncapped else None
            series = Series(names.get(which, which), measure)
            for cap, values in sorted(by_cap.items()):
                series.points.append((float(cap), sum(values) / len(values), expected_at(float(cap), base)))
            out.append(series)
    return [s for s in out if s.points]


def table(series: list[Series]) -> str:
    lines = [f"{'workload':<24} {'measure':<30} {'cap':>4} {'achieved':>9} {'expected':>9} {'off':>6}  within 2"]
    for s in series:
        for cap, achieved, expected in s.points:
            if expected is None:
                lines.append(f"{s.label:<24} {s.measure:<30} {cap:>4.0f} {achieved:>9.1f} {'-':>9} {'-':>6}  "
                             "not judged: above the uncapped use")
                continue
            off = achieved - expected
            lines.append(f"{s.label:<24} {s.measure:<30} {cap:>4.0f} {achieved:>9.1f} {expected:>9.1f} {off:>+6.2f}  "
                         f"{'yes' if abs(off) <= BAND_POINTS else 'NO'}")
    return "\n".join(lines)


def plot(series: list[Series], path: str, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(13, 6), layout="constrained")
    FigureCanvasAgg(figure)
    achieved_axes, off_axes = figure.subplots(1, 2, width_ratios=[1, 1.15])
    line = [0, 100]
    achieved_axes.plot(line, line, color="0.4", linestyle="--", linewidth=1, label="achieved = cap")
    achieved_axes.fill_between(line, [v - BAND_POINTS for v in line], [v + BAND_POINTS for v in line], color="0.88",
                               zorder=0, label=f"± {BAND_POINTS:g} points")
    off_axes.axhspan(-BAND_POINTS, BAND_POINTS, color="0.88", zorder=0, label=f"± {BAND_POINTS:g} points")
    off_axes.axhline(0, color="0.4", linestyle="--", linewidth=1)
    markers = "osD^vP*Xh<>"
    lowest = -BAND_POINTS
    for index, s in enumerate(series):
        colour, marker = f"C{index % 10}", markers[index % len(markers)]
        judged = [p for p in s.points if p[2] is not None]
        free = [p for p in s.points if p[2] is None]
        caps = [p[0] for p in judged]
        # Points of one workload spread a little sideways on the right, so that equal caps do not hide each other.
        nudge = (index - (len(series) - 1) / 2) * 0.4
        style = {"color": colour, "marker": marker, "markersize": 7,
                 "markerfacecolor": "none" if s.side_by_side else colour}
        label = f"{s.label} ({s.measure})"
        achieved_axes.plot(caps, [p[1] for p in judged], linestyle="none", label=label, **style)
        if free:
            achieved_axes.plot([p[0] for p in free], [p[1] for p in free], linestyle="none",
                               **{**style, "markerfacecolor": "none", "alpha": 0.5})
        offs = [p[1] - p[2] for p in judged]
        lowest = min([lowest, *offs])
        off_axes.plot([c + nudge for c in caps], offs, linestyle="none" if s.side_by_side or len(caps) < 2 else "-", linewidth=0.8,
                      label=label, **style)
    achieved_axes.set(xlim=(0, 100), ylim=(0, 100), xlabel="cap (%)", ylabel="achieved (%)",
                      title="achieved against the cap")
    off_axes.set(xlim=(0, 100), ylim=(min(-4.0, lowest - 1.0), 4.0), xlabel="cap (%)",
                 ylabel="achieved − expected (points)",
                 title="off the cap (hollow on the left: the cap does not bind, not judged)")
    for axes in (achieved_axes, off_axes):
        axes.grid(True, alpha=0.3)
    achieved_axes.legend(loc="upper left", fontsize="x-small")
    figure.suptitle(title)
    figure.savefig(path, dpi=110)


def describe(report: dict) -> str:
    env = report.get("env", {})
    gpu = env.get("gpu_name") or env.get("gpu") or "GPU"
    parts = [str(gpu), f"driver {env['driver']}" if env.get("driver") else None,
             f"commit {env['commit']}" if env.get("commit") else None, report.get("started")]
    return "compute caps, policy force: " + ", ".join(p for p in parts if p)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="report.json of tests/gpu/run.sh (with the compute stage)")
    parser.add_argument("--kernel-time", help="kernel-time.jsonl of tests/gpu/kernel_time.sh")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    try:
        report = read_report(args.report)
        series = series_of(report, read_kernel_time(args.kernel_time) if args.kernel_time else None)
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
