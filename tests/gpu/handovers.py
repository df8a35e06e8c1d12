"""Where the GPU's time goes when containers take turns (issue 20, item 1c): the kernels of several processes on one
GPU, on one clock, as one timeline.

    python3 tests/gpu/handovers.py A.txt B.txt [...]     (each file: one kernel a line, "start_ns end_ns")

Says, as one JSON object over the span all the processes ran in: each process's share of the time (the union of its
kernels), the time two or more ran at once (the driver time-slicing them: under time division it should be ~0), the
time nobody ran, split into the gaps at a handover (the GPU passing from one process to another) and the gaps inside
one process's run (its own synchronizes), with the handover gaps' p50 / p90 / mean; per process its runs (from the
first start after a handover to the last end before the next; under time division, about its windows) and how long
its first kernel after a handover ran against its others. Kernel intervals from
several processes line up only on one clock: mm_loop.py writes CUPTI's (MM_LOOP_INTERVALS). Standard library only:
it runs on the GPU machine."""

from __future__ import annotations

import bisect
import json
import sys
from dataclasses import dataclass, field


def union(kernels: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The kernels' intervals merged where they overlap or touch, sorted."""
    merged: list[list[int]] = []
    for start, end in sorted(kernels):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Sweep:
    """The timeline walked from one boundary to the next: what ran in each stretch."""
    busy_ns: dict[int, int] = field(default_factory=dict)  # each process: time it ran (with others or alone)
    together_ns: int = 0  # two or more at once
    idle_handover: list[int] = field(default_factory=list)  # gaps between different processes' runs
    idle_own: dict[int, list[int]] = field(default_factory=dict)  # gaps inside one process's run
    handovers: int = 0
    runs: dict[int, list[int]] = field(default_factory=dict)  # each process: its runs' lengths (first start to last
    # end of a stretch no other process ran in)


def sweep(unions: list[list[tuple[int, int]]], span: tuple[int, int]) -> Sweep:
    events = []  # (time, -1 an end / +1 a start, process), ends first at one instant
    for p, runs in enumerate(unions):
        for start, end in runs:
            if start < span[1] and end > span[0]:
                events += [(max(start, span[0]), 1, p), (min(end, span[1]), -1, p)]
    events.sort()
    out = Sweep(busy_ns={p: 0 for p in range(len(unions))}, idle_own={p: [] for p in range(len(unions))},
                runs={p: [] for p in range(len(unions))})
    run_start: int | None = None  # when the last process to run alone began its run
    last_end = span[0]
    active: set[int] = set()
    last_alone: int | None = None  # the process that last ran alone
    idle_from: int | None = None
    at = span[0]
    for t, kind, p in events:
        if t > at:
            for q in active:
                out.busy_ns[q] += t - at
            if len(active) > 1:
                out.together_ns += t - at
            at = t
        if kind == -1:
            active.discard(p)
            last_end = t
            if not active:
                idle_from = t
        else:
            if not active and idle_from is not None and last_alone is not None:
                (out.idle_own[p] if p == last_alone else out.idle_handover).append(t - idle_from)
            active.add(p)
            idle_from = None
        if len(active) == 1:
            (alone,) = active
            if last_alone is not None and alone != last_alone:
                out.handovers += 1
                if out.handovers > 1:  # (the first run began before the span: cut off)
                    out.runs[last_alone].append(last_end - run_start)
            if alone != last_alone:
                run_start = t
            last_alone = alone
    return out


def first_after_handover(kernels: list[list[tuple[int, int]]], p: int) -> tuple[list[int], list[int]]:
    """Process p's kernels' run times: those that begin after another process ran last, and the others."""
    other_ends = sorted(e for q, ks in enumerate(kernels) if q != p for _, e in ks)
    own = sorted(kernels[p])
    first, rest = [], []
    own_end = None
    for start, end in own:
        i = bisect.bisect_right(other_ends, start)
        other_end = other_ends[i - 1] if i else None
        after_other = other_end is not None and (own_end is None or other_end > own_end)
        (first if after_other else rest).append(end - start)
        own_end = end if own_end is None else max(own_end, end)
    return first, rest


def analyse(kernels: list[list[tuple[int, int]]]) -> dict:
    """The timeline of several processes' kernels: see the module's text."""
    if len(kernels) < 1 or any(not ks for ks in kernels):
        raise ValueError(f"each process needs at least one kernel; got counts {[len(ks) for ks in kernels]}")
    for p, ks in enumerate(kernels):
        for s, e in ks:
            if e < s:
                raise ValueError(f"process {p}: a kernel ends ({e}) before it starts ({s})")
    unions = [union(ks) for ks in kernels]
    span = (max(u[0][0] for u in unions), min(u[-1][1] for u in unions))
    if span[1] <= span[0]:
        raise ValueError(f"the processes ran at no common time: span {span}")
    length = span[1] - span[0]
    s = sweep(unions, span)
    ms = lambda v: None if v is None else round(v / 1e6, 3)
    result = {
        "span_s": round(length / 1e9, 6),
        "share": [round(s.busy_ns[p] / length, 4) for p in range(len(kernels))],
        "together": round(s.together_ns / length, 4),
        "idle": round(1 - (sum(s.busy_ns.values()) - s.together_ns) / length, 4),
        "idle_at_handovers": round(sum(s.idle_handover) / length, 4),
        "idle_inside_runs": [round(sum(s.idle_own[p]) / length, 4) for p in range(len(kernels))],
        "handovers_per_s": round(s.handovers / (length / 1e9), 1),
        "handover_gap_ms": {"p50": ms(percentile(s.idle_handover, 0.5)), "p90": ms(percentile(s.idle_handover, 0.9)),
                            "mean": ms(sum(s.idle_handover) / len(s.idle_handover)) if s.idle_handover else None,
                            "count": len(s.idle_handover)},
        "own_gap_ms_mean": [ms(sum(g) / len(g)) if g else None for g in s.idle_own.values()],
        # Each process's runs, handover to handover (the span's first and last, cut off by it, left out):
        "run_ms": [{"p10": ms(percentile(r, 0.1)), "p50": ms(percentile(r, 0.5)), "p90": ms(percentile(r, 0.9)),
                    "mean": ms(sum(r) / len(r)) if r else None, "count": len(r)} for r in s.runs.values()],
        "kernel_ms": [],
    }
    for p in range(len(kernels)):
        first, rest = first_after_handover(kernels, p)
        mean = lambda xs: ms(sum(xs) / len(xs)) if xs else None
        result["kernel_ms"].append({"first_after_handover": mean(first), "count_first": len(first),
                                    "others": mean(rest), "count_others": len(rest)})
    return result


def read(path: str) -> list[tuple[int, int]]:
    kernels = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 2:
                raise ValueError(f"{path}:{n}: expected 'start_ns end_ns', got {line.strip()!r}")
            kernels.append((int(parts[0]), int(parts[1])))
    return kernels


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        print(json.dumps(analyse([read(p) for p in argv[1:]])))
    except (OSError, ValueError) as e:
        print(f"handovers: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
