"""Summarizes tests/gpu/calibrate.sh's output folder as markdown (stdout): time slicing and the shim's overhead.

    python3 tests/gpu/calibrate.py OUT_DIR
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def load(path: Path) -> tuple[list[dict], dict]:
    kernels, summary = [], {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("summary"):
            summary = row
        else:
            kernels.append(row)
    return kernels, summary


def quantiles(values: list[float]) -> str:
    if not values:
        return "—"
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return f"{pick(0.1) / 1e3:.0f} / {statistics.median(values) / 1e3:.0f} / {pick(0.9) / 1e3:.0f}"


def ran_in(kernels: list[dict], t0: int, t1: int) -> float:
    """Time the kernels ran inside [t0, t1] (globaltimer): each kernel's span less its gaps, clipped."""
    total = 0.0
    for k in kernels:
        if k["exit"] <= t0 or k["entry"] >= t1:
            continue
        span = min(k["exit"], t1) - max(k["entry"], t0)
        gaps = sum(max(0, min(g[1], t1) - max(g[0], t0)) for g in k["gap"])
        total += max(0, span - gaps)
    return total


def process_row(name: str, kernels: list[dict], window: tuple[int, int]) -> dict:
    t0, t1 = window
    inside = [k for k in kernels if k["entry"] >= t0 and k["exit"] <= t1]
    ran = sum(k["ran"] for k in inside)
    event = sum(k["event_ns"] for k in inside)
    span = sum(k["exit"] - k["entry"] for k in inside)
    before = [k["event_ns"] - (k["exit"] - k["entry"]) for k in inside]
    return {
        "name": name,
        "kernels": len(inside),
        "ran_share": ran_in(kernels, t0, t1) / (t1 - t0),
        "event_over_ran": event / ran if ran else float("nan"),
        "span_over_ran": span / ran if ran else float("nan"),
        "preempted": sum(1 for k in inside if k["gaps"]) / max(1, len(inside)),
        "gaps": [g[1] - g[0] for k in inside for g in k["gap"]],
        "event_minus_span": before,
        "event_share": event / (t1 - t0),
    }


def probe_section(out: Path) -> list[str]:
    lines = ["## Time slicing (slice_probe)", "",
             "Shares are of the window both processes ran in (globaltimer). `event/ran`: what CUDA event pairs "
             "around the kernels add up to, over what the kernels ran. `gaps`: lengths of the periods a kernel was "
             "switched out, p10 / median / p90 in µs. `event − span`: event pair minus the kernel's own first-to-last "
             "timer span, median µs.", "",
             "| run | process | kernels | ran (share of window) | event sum (share) | event/ran | kernels preempted | "
             "gaps µs | event − span µs |", "|---|---|---|---|---|---|---|---|---|"]
    idle = []
    for path in sorted(out.glob("alone-*.jsonl")):
        kernels, _ = load(path)
        if not kernels:
            continue
        row = process_row("alone", kernels, (kernels[0]["entry"], kernels[-1]["exit"]))
        lines.append(table_row(path.stem, row))
    for path in sorted(out.glob("*-a.jsonl")):
        name = path.stem[:-2]
        other = out / f"{name}-b.jsonl"
        if not other.exists():
            continue
        a, _ = load(path)
        b, _ = load(other)
        if not a or not b:
            continue
        window = (max(a[0]["entry"], b[0]["entry"]), min(a[-1]["exit"], b[-1]["exit"]))
        if window[1] <= window[0]:
            continue
        rows = [process_row("a", a, window), process_row("b", b, window)]
        for row in rows:
            lines.append(table_row(name, row))
        idle.append((name, 1 - rows[0]["ran_share"] - rows[1]["ran_share"]))
    lines += ["", "Device time not run by either process of a pair (switching, and idle time where a process was "
              "throttled): " + ", ".join(f"{name} {share * 100:.1f} %" for name, share in idle), ""]
    return lines


def table_row(run: str, row: dict) -> str:
    minus = statistics.median(row["event_minus_span"]) / 1e3 if row["event_minus_span"] else float("nan")
    return (f"| {run} | {row['name']} | {row['kernels']} | {row['ran_share'] * 100:.1f} % | "
            f"{row['event_share'] * 100:.1f} % | {row['event_over_ran']:.3f} | {row['preempted'] * 100:.0f} % | "
            f"{quantiles(row['gaps'])} | {minus:.1f} |")


def overhead_section(out: Path) -> list[str]:
    path = out / "overhead.jsonl"
    if not path.exists():
        return []
    rounds: dict[int, dict[str, dict]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        rounds.setdefault(row["round"], {})[row["config"]] = row
    lines = ["## Overhead (vgpu-tenant, one CPU, interleaved rounds)", "",
             "Per round, each configuration's rate over the same round's no-shim rate; the median over rounds "
             "(and the spread p10..p90). `depth 64`: empty-kernel launches with 64 in flight (launch rate); "
             "`depth 1`: launch + wait for each (small-op latency).", "",
             "| configuration | depth 64: kernels/s (median) | vs none | depth 1: kernels/s | vs none |",
             "|---|---|---|---|---|"]
    configs = ["none", "shim", "shim_mem", "shim_limits"]
    for config in configs:
        rates64, rates1, ratio64, ratio1 = [], [], [], []
        for entries in rounds.values():
            if config not in entries or "none" not in entries:
                continue
            r64 = entries[config]["depth64"].get("kernels_per_s")
            r1 = entries[config]["depth1"].get("kernels_per_s")
            n64 = entries["none"]["depth64"].get("kernels_per_s")
            n1 = entries["none"]["depth1"].get("kernels_per_s")
            if r64 and n64:
                rates64.append(r64)
                ratio64.append(r64 / n64)
            if r1 and n1:
                rates1.append(r1)
                ratio1.append(r1 / n1)
        lines.append(f"| {config} | {statistics.median(rates64):.0f} | {change(ratio64)} | "
                     f"{statistics.median(rates1):.0f} | {change(ratio1)} |" if rates64 and rates1 else
                     f"| {config} | — | — | — | — |")
    return lines + [""]


def change(ratios: list[float]) -> str:
    ratios = sorted(ratios)
    loss = lambda r: (1 - r) * 100  # noqa: E731  (a rate lower than none's: + is slower)
    return (f"{loss(statistics.median(ratios)):+.1f} % ({loss(ratios[int(0.9 * (len(ratios) - 1))]):+.1f} .. "
            f"{loss(ratios[int(0.1 * (len(ratios) - 1))]):+.1f})")


def calls_section(out: Path) -> list[str]:
    path = out / "call_costs.jsonl"
    if not path.exists():
        return []
    costs: dict[str, dict[str, list[float]]] = {}
    by_round: dict[str, dict[int, dict[str, float]]] = {}
    configs: list[str] = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        costs.setdefault(row["call"], {}).setdefault(row["config"], []).append(row["ns"])
        by_round.setdefault(row["call"], {}).setdefault(row.get("round", 0), {})[row["config"]] = row["ns"]
        if row["config"] != "none" and row["config"] not in configs:
            configs.append(row["config"])
    lines = ["## Driver calls on the launch path (tests/gpu/call_costs.cu, one CPU)", "",
             "Host ns per call (median of 21 batches of 2000, then the median over rounds); `gpu:` rows are GPU time "
             "between events. Other than `none`, each configuration is a build of libvgpu.so with a 99 % compute cap "
             "(the runtime's launches go through the shim's launch path); `shim_limits` is this tree's. Added: per "
             "round, the configuration over the same round's `none`; the median over rounds (p10 .. p90).", "",
             "| call | none | " + " | ".join(f"{c} | added" for c in configs) + " |",
             "|---|---|" + "---|---|" * len(configs)]
    for call, by_config in costs.items():
        none = statistics.median(by_config["none"]) if by_config.get("none") else None
        cells = []
        for config in configs:
            shim = statistics.median(by_config[config]) if by_config.get(config) else None
            # The same round's runs, one after the other: a slow minute of the host hits both.
            ratios = sorted(r[config] / r["none"] - 1 for r in by_round[call].values() if r.get("none") and r.get(config))
            added = (f"{statistics.median(ratios) * 100:+.1f} % ({ratios[int(0.1 * (len(ratios) - 1))] * 100:+.1f} .. "
                     f"{ratios[int(0.9 * (len(ratios) - 1))] * 100:+.1f})" if ratios else "—")
            cells.append(f"{shim if shim is None else f'{shim:.1f}'} | {added}")
        lines.append(f"| {call} | {none if none is None else f'{none:.1f}'} | " + " | ".join(cells) + " |")
    return lines + [""]


def inproc_section(out: Path) -> list[str]:
    path = out / "launch_ab.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lines = ["## The launch path inside one process (tests/gpu/launch_ab.cc, one CPU)", "",
             "41 pairs of batches, through the hook and straight into the driver's cuLaunchKernel, alternating; host ns "
             "per launch (medians) and the median over pairs of hooked / driver - 1 (p10 .. p90). `none`: no shim, "
             "both paths the driver's (the A/A check). Other configurations: a build of libvgpu.so with a 99 % compute "
             "cap (`shim_limits`: this commit's).", "",
             "| round | configuration | pattern | hooked ns | driver ns | added |", "|---|---|---|---|---|---|"]
    for row in rows:
        if "calls" in row:
            continue
        lines.append(f"| {row.get('round', '')} | {row['config']} | {row['pattern']} | {row['hooked_ns']:.1f} | "
                     f"{row['driver_ns']:.1f} | {row['added'] * 100:+.1f} % ({row['added_p10'] * 100:+.1f} .. "
                     f"{row['added_p90'] * 100:+.1f}) |")
    # Single calls: the added median says what every launch pays, the added mean what the few measured ones add.
    single = [row for row in rows if "calls" in row]
    if single:
        lines += ["", "Single calls, added ns through the hook (hooked - driver): the median of the p50s over the 16 "
                  "positions of the 16-deep launches, and of launch+sync's launch call; the mean likewise.", "",
                  "| round | configuration | 16 deep p50 | 16 deep mean | launch+sync launch p50 | mean |",
                  "|---|---|---|---|---|---|"]
        keys = sorted({(row.get("round", 0), row["config"]) for row in single})
        for key in keys:
            mine = [row for row in single if (row.get("round", 0), row["config"]) == key]
            deep = [row for row in mine if row["pattern"] == "16 deep"]
            launch = [row for row in mine if row["calls"] == "launch"]
            if not deep or not launch:
                continue
            p50 = sorted(row["hooked"][0] - row["driver"][0] for row in deep)[len(deep) // 2]
            mean = sorted(row["hooked"][3] - row["driver"][3] for row in deep)[len(deep) // 2]
            lines.append(f"| {key[0]} | {key[1]} | {p50:+.0f} | {mean:+.0f} | "
                         f"{launch[0]['hooked'][0] - launch[0]['driver'][0]:+.0f} | "
                         f"{launch[0]['hooked'][3] - launch[0]['driver'][3]:+.0f} |")
    return lines + [""]


def main() -> int:
    out = Path(sys.argv[1])
    machine = (out / "machine.txt").read_text() if (out / "machine.txt").exists() else ""
    print("# Calibration run\n\n```\n" + machine.strip() + "\n```\n")
    print("\n".join(probe_section(out) + calls_section(out) + inproc_section(out) + overhead_section(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
