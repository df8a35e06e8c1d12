"""A run's trace (docs/scenarios.md, "The trace") as numpy structured arrays and pandas DataFrames.

    trace = vgpu.trace.read_trace("run.jsonl")        # or parse_trace(text)
    trace.samples          # structured array: t_ns, tenant (index), device, busy_ns (cumulative), memory_bytes
    trace.gpu              # structured array: t_ns, device, util_percent, memory_used_bytes (NVML's view)
    trace.events           # structured array: process / oom / exit events (ev, t_ns, tenant, process, pid, ...)
    trace.window_shares()  # DataFrame: one row per tenant and window: start_ns, end_ns, busy_ns, share_percent, ...
    trace.sample_shares()  # the same per sample period

A tenant's share in a period is (busy at its end - busy at its start) / period, busy read from the tenant's
samples. Busy time at a time between two samples is interpolated linearly (live samples are taken close to, not
exactly at, the period's multiples); before the first sample it rises from 0 at the run's start. A period ending
later than half a sample period after the tenant's last sample is incomplete (the run was cut short): it is marked
`complete=False` and never judged. A tenant on several devices: its share is the busy time summed over the devices
it used (busy at some point) divided by the period times their number; per_device=True gives each device's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

SAMPLE_DTYPE = np.dtype([("t_ns", "<i8"), ("tenant", "<i4"), ("device", "<i4"), ("busy_ns", "<i8"),
                         ("memory_bytes", "<i8")])
GPU_DTYPE = np.dtype([("t_ns", "<i8"), ("device", "<i4"), ("util_percent", "<i4"), ("memory_used_bytes", "<i8")])
# process: started (pid 0 in virtual mode); oom: `bytes` refused; exit: status ok|oom|killed|error and its code.
# Fields an event does not have are -1 ("" for status).
EVENT_DTYPE = np.dtype([("ev", "U8"), ("t_ns", "<i8"), ("tenant", "<i4"), ("process", "<i4"), ("pid", "<i8"),
                        ("device", "<i4"), ("bytes", "<i8"), ("status", "U8"), ("code", "<i8")])

KNOWN_EVENTS = ("run", "tenant", "process", "sample", "gpu", "oom", "exit", "end")


class TraceError(ValueError):
    """A trace that cannot be read: the message names the file and the line."""


@dataclass
class Trace:
    run: dict
    tenants: list[dict]                 # the `tenant` events, in index order
    samples: np.ndarray                 # SAMPLE_DTYPE, in file order
    gpu: np.ndarray                     # GPU_DTYPE
    events: np.ndarray                  # EVENT_DTYPE
    end: dict | None = None             # the `end` event; None if the run did not finish its trace
    source: str = "<trace>"
    unknown: list[dict] = field(default_factory=list)  # events of kinds this version does not know (kept, not used)

    # -- the run's parameters ----------------------------------------------------------------------------------
    @property
    def tenant_names(self) -> list[str]:
        return [t["tenant"] for t in self.tenants]

    @property
    def mode(self) -> str:
        return str(self.run.get("mode", ""))

    @property
    def duration_ns(self) -> int:
        if "duration_ns" in self.run:
            return int(self.run["duration_ns"])
        return int(self.samples["t_ns"].max()) if len(self.samples) else 0

    @property
    def settle_ns(self) -> int:
        return int(self.run.get("settle_ns", 0))

    @property
    def window_ns(self) -> int:
        return int(self.run.get("window_ns", 1_000_000_000))

    @property
    def sample_ns(self) -> int:
        return int(self.run.get("sample_ns", 100_000_000))

    @property
    def leaked_bytes(self) -> int | None:
        return None if self.end is None else int(self.end.get("leaked_bytes", 0))

    def tenant_index(self, name: str) -> int:
        for index, tenant in enumerate(self.tenants):
            if tenant["tenant"] == name:
                return index
        raise KeyError(f"no tenant {name!r} in {self.source} (tenants: {', '.join(self.tenant_names)})")

    # -- DataFrames ----------------------------------------------------------------------------------------------
    def _names(self, indices: np.ndarray) -> np.ndarray:
        names = np.array(self.tenant_names + [""], dtype=object)
        return names[np.where(indices >= 0, indices, len(names) - 1)]

    def samples_frame(self) -> pd.DataFrame:
        frame = pd.DataFrame(self.samples).rename(columns={"tenant": "tenant_index"})
        frame.insert(1, "tenant", self._names(self.samples["tenant"]))
        frame["t_s"] = frame["t_ns"] / 1e9
        return frame

    def gpu_frame(self) -> pd.DataFrame:
        frame = pd.DataFrame(self.gpu)
        frame["t_s"] = frame["t_ns"] / 1e9
        return frame

    def events_frame(self) -> pd.DataFrame:
        frame = pd.DataFrame(self.events).rename(columns={"tenant": "tenant_index"})
        frame.insert(2, "tenant", self._names(self.events["tenant"]))
        frame["t_s"] = frame["t_ns"] / 1e9
        return frame

    def tenants_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.tenants)

    # -- busy time and shares ------------------------------------------------------------------------------------
    def _series(self, tenant: int, device: int) -> tuple[np.ndarray, np.ndarray]:
        rows = self.samples[(self.samples["tenant"] == tenant) & (self.samples["device"] == device)]
        order = np.argsort(rows["t_ns"], kind="stable")
        t = rows["t_ns"][order].astype(np.float64)
        busy = rows["busy_ns"][order].astype(np.float64)
        if len(t) == 0 or t[0] > 0:
            t = np.concatenate(([0.0], t))
            busy = np.concatenate(([0.0], busy))
        return t, busy

    def busy_at(self, tenant: int | str, device: int, times_ns) -> np.ndarray:
        """A tenant's cumulative busy time on `device` at each of `times_ns` (interpolated between samples)."""
        index = self.tenant_index(tenant) if isinstance(tenant, str) else int(tenant)
        t, busy = self._series(index, device)
        return np.interp(np.asarray(times_ns, dtype=np.float64), t, busy)

    def devices_of(self, tenant: int) -> list[int]:
        """The devices a tenant's samples name, those with busy time first (all of them if none had any)."""
        rows = self.samples[self.samples["tenant"] == tenant]
        devices = sorted(set(int(d) for d in rows["device"]))
        used = [d for d in devices if rows["busy_ns"][rows["device"] == d].max(initial=0) > 0]
        return used or devices

    def shares(self, period_ns: int | None = None, per_device: bool = False) -> pd.DataFrame:
        """Each tenant's share per period from the run's start (default: the window), as a DataFrame.

        Columns: tenant, tenant_index, [device,] period (0, 1, ...), start_ns, end_ns, busy_ns, share (a fraction),
        share_percent, complete. Only whole periods within the run's duration.
        """
        period = int(period_ns or self.window_ns)
        if period <= 0:
            raise ValueError(f"the period must be positive, not {period}")
        count = self.duration_ns // period
        starts = np.arange(count, dtype=np.int64) * period
        ends = starts + period
        columns = ["tenant", "tenant_index"] + (["device"] if per_device else []) + \
                  ["period", "start_ns", "end_ns", "busy_ns", "share", "share_percent", "complete"]
        parts = []
        for index, name in enumerate(self.tenant_names):
            devices = self.devices_of(index)
            if not devices or count == 0:
                continue
            groups = [[d] for d in devices] if per_device else [devices]
            for group in groups:
                busy = np.zeros(count)
                last = np.inf
                for device in group:
                    at = self.busy_at(index, device, np.concatenate((starts, ends[-1:])))
                    busy += np.diff(at)
                    t, _ = self._series(index, device)
                    last = min(last, t[-1])
                share = busy / (period * len(group))
                part = {"tenant": name, "tenant_index": index}
                if per_device:
                    part["device"] = group[0]
                part.update(period=np.arange(count), start_ns=starts, end_ns=ends, busy_ns=busy, share=share,
                            share_percent=share * 100.0, complete=ends <= last + self.sample_ns / 2)
                parts.append(pd.DataFrame(part))
        if not parts:
            return pd.DataFrame({c: pd.Series(dtype=object) for c in columns})
        return pd.concat(parts, ignore_index=True)[columns]

    def window_shares(self, per_device: bool = False) -> pd.DataFrame:
        return self.shares(self.window_ns, per_device)

    def sample_shares(self, per_device: bool = False) -> pd.DataFrame:
        return self.shares(self.sample_ns, per_device)

    def active_span(self, tenant: int | str) -> tuple[int, int]:
        """[first process start, last process exit) of a tenant; the run's end if some process never exited."""
        index = self.tenant_index(tenant) if isinstance(tenant, str) else int(tenant)
        mine = self.events[self.events["tenant"] == index]
        starts = mine[mine["ev"] == "process"]
        exits = mine[mine["ev"] == "exit"]
        begin = int(starts["t_ns"].min()) if len(starts) else 0
        stopped = {int(p) for p in exits["process"]}
        started = {int(p) for p in starts["process"]}
        if len(exits) and started and started <= stopped:
            end = int(exits["t_ns"].max())
        else:
            end = self.duration_ns
        return begin, max(begin, end)


def _int(event: dict, key: str, default: int = -1) -> int:
    value = event.get(key, default)
    return default if value is None else int(value)


def parse_trace(text: str, source: str = "<trace>") -> Trace:
    """Reads a trace from its text (JSON lines). TraceError names the line of anything malformed."""
    return _parse(text.splitlines(), source)


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Reads a trace file. TraceError names the file and line of anything malformed; OSError if unreadable."""
    with open(path, encoding="utf-8") as handle:
        return _parse(handle, os.fspath(path))


def _parse(lines, source: str) -> Trace:
    run: dict = {}
    tenants: dict[str, dict] = {}
    samples: list[tuple] = []
    gpu: list[tuple] = []
    raw_events: list[tuple[str, dict]] = []
    end = None
    unknown: list[dict] = []
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError as error:
            raise TraceError(f"{source}:{number}: not a JSON line ({error})") from None
        if not isinstance(event, dict) or "ev" not in event:
            raise TraceError(f"{source}:{number}: not a trace event (an object with \"ev\")")
        kind = event["ev"]
        try:
            if kind == "run":
                run = event
            elif kind == "tenant":
                entry = dict(event)
                entry.setdefault("index", len(tenants))
                tenants[event["tenant"]] = entry
            elif kind == "sample":
                samples.append((int(event["t_ns"]), event["tenant"], _int(event, "device", 0), int(event["busy_ns"]),
                                _int(event, "memory_bytes", 0)))
            elif kind == "gpu":
                gpu.append((int(event["t_ns"]), _int(event, "device", 0), _int(event, "util_percent", 0),
                            _int(event, "memory_used_bytes", 0)))
            elif kind in ("process", "oom", "exit"):
                int(event["t_ns"])
                event["tenant"]
                raw_events.append((kind, event))
            elif kind == "end":
                end = event
            else:
                unknown.append(event)
        except (KeyError, TypeError, ValueError) as error:
            missing = f"no {error}" if isinstance(error, KeyError) else str(error)
            raise TraceError(f"{source}:{number}: a {kind!r} event with a missing or bad field ({missing})") from None

    ordered = sorted(tenants.values(), key=lambda t: int(t["index"]))
    # Tenants named only by samples or events (a trace without its tenant lines) get indices after the others.
    names = [t["tenant"] for t in ordered]
    for name in [s[1] for s in samples] + [e["tenant"] for _, e in raw_events]:
        if name not in names:
            names.append(name)
            ordered.append({"ev": "tenant", "tenant": name, "index": len(ordered)})
    index_of = {name: i for i, name in enumerate(names)}

    sample_array = np.array([(t, index_of[n], d, b, m) for t, n, d, b, m in samples], dtype=SAMPLE_DTYPE)
    gpu_array = np.array(gpu, dtype=GPU_DTYPE)
    event_array = np.array(
        [(kind, int(e["t_ns"]), index_of[e["tenant"]], _int(e, "process"), _int(e, "pid"), _int(e, "device"),
          _int(e, "bytes"), str(e.get("status", "")), _int(e, "code")) for kind, e in raw_events],
        dtype=EVENT_DTYPE)
    return Trace(run=run, tenants=ordered, samples=sample_array, gpu=gpu_array, events=event_array, end=end,
                 source=source, unknown=unknown)


__all__ = ["EVENT_DTYPE", "GPU_DTYPE", "SAMPLE_DTYPE", "Trace", "TraceError", "parse_trace", "read_trace"]
