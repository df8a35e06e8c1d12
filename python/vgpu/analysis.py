"""Judging a run: a summary per tenant and every expectation checked (docs/scenarios.md, "Results and expectations").

    report = vgpu.analysis.summarize(trace, scenario)     # scenario: a loaded Scenario, its to_dict(), or None
    report.passed, report.tenants, report.checks, report.to_dict()

Definitions (shares in percent of wall time, per window of the run, see vgpu.trace):
- judged windows: the complete windows starting at or after `settle` and ending by the run's duration; an
  expectation judges those in [max(settle, from), to).
- mean share: the mean of the judged windows' shares. error: mean share - cap (points), for a tenant with a cap
  (nvidia.com/gpucores between 1 and 99).
- convergence time (from the run's start): the start of the first window from which every complete window inside
  the tenant's active span (its first process start to its last process exit, or the run's end) stays within the
  tolerance of the cap; None if the last one does not.
- worst window: the judged window furthest from the tenant's reference: its `share` expectation's target if it has
  one, else its cap (None for an uncapped tenant without a share expectation).
- fairness: Jain's index (sum x)^2 / (n sum x^2) of x = mean share / cap over the capped tenants (1 = each got the
  same fraction of its cap); None without a capped tenant or when every x is 0.
- OOM events: the trace's `oom` events per tenant. Leaked memory: the `end` event's leaked_bytes.

Checks:
- share: |mean - target| <= tolerance (the expectation's, else 2 points in virtual mode, 3 live); with
  worst_window, a second check: every judged window within worst_window points of the target.
- min_share / max_share: every judged window >= bound / <= bound; a tolerance written on the expectation widens it
  (none by default: a bound is a bound).
- oom: true: the tenant has an OOM event; false, and for every tenant with no oom expectation (docs: "default: none
  may"), it has none.
- leaked_bytes: the end event's leaked_bytes <= expect.leaked_bytes (default 0); a trace without an end event fails.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from .trace import Trace

DEFAULT_TOLERANCE = {"virtual": 2.0, "live": 3.0}


def default_tolerance(mode: str) -> float:
    return DEFAULT_TOLERANCE.get(mode, DEFAULT_TOLERANCE["live"])


def jain_index(values) -> float | None:
    """(sum x)^2 / (n sum x^2); None for no values or all zero."""
    x = np.asarray(list(values), dtype=np.float64)
    if len(x) == 0:
        return None
    squares = float(np.sum(x * x))
    if squares == 0:
        return None
    return float(np.sum(x)) ** 2 / (len(x) * squares)


def convergence_time(starts_ns, shares_percent, cap_percent: float, tolerance_points: float) -> int | None:
    """The start of the first window from which every window is within the tolerance of the cap; None if the last
    one is not (or there are none)."""
    starts = np.asarray(starts_ns)
    inside = np.abs(np.asarray(shares_percent, dtype=np.float64) - cap_percent) <= tolerance_points + 1e-9
    if len(inside) == 0 or not inside[-1]:
        return None
    outside = np.flatnonzero(~inside)
    first = 0 if len(outside) == 0 else int(outside[-1]) + 1
    return int(starts[first])


@dataclass
class TenantSummary:
    name: str
    index: int
    cap_percent: float | None            # None: no compute limit
    policy: str
    memory_limit_bytes: int              # 0: none
    devices: list[int]
    judged_windows: int
    mean_share_percent: float | None     # None: no judged window
    error_points: float | None           # mean - cap
    convergence_ns: int | None
    worst_window: dict | None            # start_ns, end_ns, share_percent, reference_percent, deviation_points
    oom_events: int
    peak_memory_bytes: int
    exits: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Check:
    kind: str                            # share | worst_window | min_share | max_share | oom | programs | leaked_bytes
    tenant: str | None                   # None: about the whole run
    passed: bool
    expected: str                        # the promise, in words ("30 +/- 2 points")
    measured: float | None
    detail: str
    line: int | None = None              # of the expectation in the scenario file
    implicit: bool = False               # a default expectation (no OOM, no leak) rather than a written one

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        who = self.tenant if self.tenant is not None else "run"
        return f"{'PASS' if self.passed else 'FAIL'}  {who}: {self.kind} {self.expected}: {self.detail}"


@dataclass
class Report:
    scenario: str
    file: str
    mode: str
    tolerance_points: float
    duration_ns: int
    settle_ns: int
    window_ns: int
    tenants: list[TenantSummary]
    fairness: float | None
    leaked_bytes: int | None
    checks: list[Check]
    finished: bool                       # the trace has its end event

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [check for check in self.checks if not check.passed]

    def tenant(self, name: str) -> TenantSummary:
        for summary in self.tenants:
            if summary.name == name:
                return summary
        raise KeyError(name)

    def to_dict(self) -> dict:
        return {"scenario": self.scenario, "file": self.file, "mode": self.mode, "passed": self.passed,
                "tolerance_points": self.tolerance_points, "duration_ns": self.duration_ns,
                "settle_ns": self.settle_ns, "window_ns": self.window_ns, "fairness": self.fairness,
                "leaked_bytes": self.leaked_bytes, "finished": self.finished,
                "tenants": [t.to_dict() for t in self.tenants], "checks": [c.to_dict() for c in self.checks]}


def scenario_tree(scenario) -> dict | None:
    """A scenario as a plain dict tree (a native Scenario's to_dict(), a dict as is, None as is)."""
    if scenario is None or isinstance(scenario, dict):
        return scenario
    return scenario.to_dict()


def _cap(tenant_event: dict) -> float | None:
    cores = float(tenant_event.get("cores_percent", 0) or 0)
    return cores if 0 < cores < 100 else None


def _seconds(ns: float) -> str:
    return f"{ns / 1e9:g} s"


def _judged(windows: pd.DataFrame, from_ns: int, to_ns: int) -> pd.DataFrame:
    return windows[(windows["start_ns"] >= from_ns) & (windows["end_ns"] <= to_ns) & windows["complete"].astype(bool)]


def summarize(trace: Trace, scenario=None, mode: str | None = None, tolerance: float | None = None) -> Report:
    """Summarizes a trace and checks the scenario's expectations (none but the defaults if `scenario` is None).

    `tolerance` replaces the mode's default (2 points virtual, 3 live) for share expectations that name none.
    """
    tree = scenario_tree(scenario)
    mode = mode or trace.mode or "virtual"
    tolerance = default_tolerance(mode) if tolerance is None else float(tolerance)
    duration, settle = trace.duration_ns, trace.settle_ns
    windows = trace.window_shares()
    specs = {t["name"]: t for t in (tree or {}).get("tenants", [])}

    tenants: list[TenantSummary] = []
    checks: list[Check] = []
    for index, event in enumerate(trace.tenants):
        name = event["tenant"]
        spec = specs.get(name, {})
        cap = _cap(event) if event.get("cores_percent") is not None else _cap(spec)
        mine = windows[windows["tenant_index"] == index] if len(windows) else windows
        judged = _judged(mine, settle, duration) if len(mine) else mine
        mean = float(judged["share_percent"].mean()) if len(judged) else None

        span_begin, span_end = trace.active_span(index)
        convergence = None
        if cap is not None and len(mine):
            in_span = mine[(mine["start_ns"] >= span_begin) & (mine["end_ns"] <= span_end) & mine["complete"].astype(bool)]
            convergence = convergence_time(in_span["start_ns"], in_span["share_percent"], cap, tolerance)

        share_targets = [e for e in spec.get("expect", []) if e.get("kind") == "share"]
        reference = float(share_targets[0]["percent"]) if share_targets else cap
        worst = None
        if reference is not None and len(judged):
            deviation = (judged["share_percent"] - reference).abs()
            row = judged.loc[deviation.idxmax()]
            worst = {"start_ns": int(row["start_ns"]), "end_ns": int(row["end_ns"]),
                     "share_percent": float(row["share_percent"]), "reference_percent": reference,
                     "deviation_points": float(row["share_percent"] - reference)}

        events = trace.events[trace.events["tenant"] == index]
        ooms = int(np.sum(events["ev"] == "oom"))
        exits: dict[str, int] = {}
        for status in events["status"][events["ev"] == "exit"]:
            exits[str(status)] = exits.get(str(status), 0) + 1
        samples = trace.samples[trace.samples["tenant"] == index]
        peak = int(samples["memory_bytes"].max()) if len(samples) else 0

        tenants.append(TenantSummary(
            name=name, index=index, cap_percent=cap, policy=str(event.get("policy", spec.get("policy", ""))),
            memory_limit_bytes=int(event.get("memory_limit_bytes", spec.get("memory_limit_bytes", 0)) or 0),
            devices=[int(d) for d in event.get("devices", spec.get("devices", []))], judged_windows=len(judged),
            mean_share_percent=mean, error_points=None if mean is None or cap is None else mean - cap,
            convergence_ns=convergence, worst_window=worst, oom_events=ooms, peak_memory_bytes=peak, exits=exits))

        checks += _tenant_checks(name, spec.get("expect", []), mine, settle, duration, tolerance, ooms)
        checks += _program_checks(name, spec, events)

    capped = [t for t in tenants if t.cap_percent is not None and t.mean_share_percent is not None]
    fairness = jain_index(t.mean_share_percent / t.cap_percent for t in capped)

    leaked = trace.leaked_bytes
    allowed = int((tree or {}).get("expect_leaked_bytes", 0) or 0)
    if leaked is None:
        checks.append(Check("leaked_bytes", None, False, f"<= {allowed} bytes", None,
                            "the trace has no end event: the run did not finish", implicit=tree is None))
    else:
        checks.append(Check("leaked_bytes", None, leaked <= allowed, f"<= {allowed} bytes", float(leaked),
                            f"{leaked} bytes still held after every process ended", implicit=tree is None))

    return Report(scenario=str(trace.run.get("scenario", (tree or {}).get("name", ""))),
                  file=str(trace.run.get("file", (tree or {}).get("file", ""))), mode=mode,
                  tolerance_points=tolerance, duration_ns=duration, settle_ns=settle, window_ns=trace.window_ns,
                  tenants=tenants, fairness=fairness, leaked_bytes=leaked, checks=checks,
                  finished=trace.end is not None)


def _tenant_checks(name: str, expectations: list[dict], windows: pd.DataFrame, settle: int, duration: int,
                   tolerance: float, ooms: int) -> list[Check]:
    checks: list[Check] = []
    has_oom_expectation = False
    for expectation in expectations:
        kind = expectation.get("kind")
        line = expectation.get("line")
        if kind == "oom":
            has_oom_expectation = True
            wanted = bool(expectation.get("oom"))
            passed = ooms > 0 if wanted else ooms == 0
            checks.append(Check("oom", name, passed, "some process runs out of memory" if wanted else "no OOM",
                                float(ooms), f"{ooms} OOM event{'s' if ooms != 1 else ''}", line))
            continue
        from_ns = max(settle, int(expectation.get("from_ns") or 0))
        to_ns = int(expectation.get("to_ns") or duration)
        judged = _judged(windows, from_ns, to_ns) if len(windows) else windows
        period = f"[{_seconds(from_ns)}, {_seconds(to_ns)})"
        percent = float(expectation["percent"])
        written_tolerance = expectation.get("tolerance_points")
        if kind == "share":
            points = tolerance if written_tolerance is None else float(written_tolerance)
            expected = f"{percent:g} +/- {points:g} points over {period}"
        elif kind in ("min_share", "max_share"):
            points = 0.0 if written_tolerance is None else float(written_tolerance)
            sign = ">=" if kind == "min_share" else "<="
            expected = f"{sign} {percent:g}{f' (+/- {points:g})' if points else ''} over {period}"
        else:
            checks.append(Check(str(kind), name, False, "?", None, f"unknown expectation kind {kind!r}", line))
            continue
        if len(judged) == 0:
            checks.append(Check(kind, name, False, expected, None, f"no complete window in {period} to judge", line))
            continue
        mean = float(judged["share_percent"].mean())
        windows_text = f"{len(judged)} window{'s' if len(judged) != 1 else ''}"
        if kind == "share":
            passed = abs(mean - percent) <= points + 1e-9
            checks.append(Check(kind, name, passed, expected, mean, f"mean {mean:.2f} % over {windows_text}", line))
        else:
            # A bound holds in every judged window, not only on average (docs/scenarios.md).
            at = judged["share_percent"].idxmin() if kind == "min_share" else judged["share_percent"].idxmax()
            extreme = float(judged.loc[at, "share_percent"])
            passed = (extreme >= percent - points - 1e-9) if kind == "min_share" else (extreme <= percent + points + 1e-9)
            checks.append(Check(kind, name, passed, expected, extreme,
                                f"{'lowest' if kind == 'min_share' else 'highest'} {extreme:.2f} % in the window at "
                                f"{_seconds(int(judged.loc[at, 'start_ns']))} (mean {mean:.2f} % over {windows_text})",
                                line))
        worst_points = expectation.get("worst_window_points")
        if kind == "share" and worst_points is not None:
            deviation = (judged["share_percent"] - percent).abs()
            at = deviation.idxmax()
            worst = float(deviation[at])
            checks.append(Check("worst_window", name, worst <= float(worst_points) + 1e-9,
                                f"every window within {float(worst_points):g} points of {percent:g} over {period}",
                                worst, f"worst {float(judged.loc[at, 'share_percent']):.2f} % in the window at "
                                       f"{_seconds(int(judged.loc[at, 'start_ns']))}", line))
    if not has_oom_expectation:
        checks.append(Check("oom", name, ooms == 0, "no OOM", float(ooms),
                            f"{ooms} OOM event{'s' if ooms != 1 else ''}", implicit=True))
    return checks


def _program_indices(spec: dict) -> set[int]:
    """The trace's process numbers of a tenant's `program:` processes (replicas in order, as the runner counts)."""
    indices, index = set(), 0
    for process in spec.get("processes", []):
        replicas = int(process.get("replicas", 1) or 1)
        if process.get("program"):
            indices.update(range(index, index + replicas))
        index += replicas
    return indices


def _program_checks(name: str, spec: dict, events) -> list[Check]:
    """A tenant's programs judge themselves: each must end `ok` (exit 0, or ended when stopped at its stop)."""
    programs = _program_indices(spec)
    if not programs:
        return []
    exits = events[(events["ev"] == "exit") & np.isin(events["process"], sorted(programs))]
    failed = [f"process {int(e['process'])}: {e['status']} (code {int(e['code'])})" for e in exits if e["status"] != "ok"]
    ended = len(exits)
    detail = (f"{ended} of {len(programs)} program{'s' if len(programs) != 1 else ''} ended ok" if not failed
              else "; ".join(failed))
    passed = not failed and ended == len(programs)
    if not failed and ended != len(programs):
        detail = f"only {ended} of {len(programs)} programs ended (the run was cut short)"
    return [Check("programs", name, passed, "every program ends ok (exit 0, or stopped at its stop)",
                  float(len(programs) - len(failed)), detail, implicit=True)]


def format_bytes(value: int | float | None) -> str:
    if value is None:
        return "-"
    value = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(value)


def format_report(report: Report) -> str:
    """The human summary `vgpu run` prints: a table per tenant, then every check."""
    verdict = "PASS" if report.passed else "FAIL"
    held = sum(c.passed for c in report.checks)
    lines = [f"{report.scenario} ({report.file}), {report.mode}, {report.duration_ns / 1e9:g} s: {verdict} "
             f"({held}/{len(report.checks)} expectations held)"
             + ("" if report.finished else " [the run did not finish]")]
    header = ("tenant", "cap", "mean share", "error", "worst window", "converged", "OOM", "peak memory / limit")
    rows = [header]
    for t in report.tenants:
        worst = "-" if t.worst_window is None else \
            f"{t.worst_window['share_percent']:.1f} % at {t.worst_window['start_ns'] / 1e9:g} s"
        rows.append((
            t.name, "-" if t.cap_percent is None else f"{t.cap_percent:g} %",
            "-" if t.mean_share_percent is None else f"{t.mean_share_percent:.1f} %",
            "-" if t.error_points is None else f"{round(t.error_points, 1) + 0.0:+.1f}",
            worst,
            "-" if t.cap_percent is None else ("never" if t.convergence_ns is None else f"{t.convergence_ns / 1e9:g} s"),
            str(t.oom_events),
            f"{format_bytes(t.peak_memory_bytes)} / "
            f"{format_bytes(t.memory_limit_bytes) if t.memory_limit_bytes else 'none'}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    fairness = "-" if report.fairness is None else f"{report.fairness:.4f}"
    lines.append(f"  fairness (Jain's index of share/cap): {fairness}    leaked: {format_bytes(report.leaked_bytes)}")
    lines.append("expectations:")
    for check in report.checks:
        lines.append(f"  {check}" + (" (default)" if check.implicit else ""))
    return "\n".join(lines)


__all__ = ["Check", "DEFAULT_TOLERANCE", "Report", "TenantSummary", "convergence_time", "default_tolerance",
           "format_bytes", "format_report", "jain_index", "scenario_tree", "summarize"]
