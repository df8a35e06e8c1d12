"""vgpu.trace: the trace's JSON lines as numpy structured arrays and DataFrames, shares per window and per sample."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vgpu_fixtures import GIB, MS, SECOND, TraceWriter

from vgpu.trace import EVENT_DTYPE, GPU_DTYPE, SAMPLE_DTYPE, TraceError, parse_trace, read_trace


def two_tenants() -> TraceWriter:
    writer = TraceWriter(duration_ns=3 * SECOND).tenant("a", cores=30, memory_limit=4 * GIB).tenant("b", cores=70)
    writer.process("a", pid=11).process("b", pid=12)
    writer.window_shares("a", [20, 30, 40], memory_bytes=GIB).window_shares("b", [80, 70, 60])
    writer.event(ev="gpu", t_ns=100 * MS, device=0, util_percent=100, memory_used_bytes=2 * GIB)
    writer.event(ev="oom", t_ns=SECOND, tenant="a", process=0, bytes=8 * GIB)
    writer.event(ev="exit", t_ns=SECOND, tenant="a", process=0, status="oom", code=2)
    return writer.end()


def test_arrays_and_frames(tmp_path):
    trace = read_trace(two_tenants().write(tmp_path / "t.jsonl"))
    assert trace.samples.dtype == SAMPLE_DTYPE and trace.gpu.dtype == GPU_DTYPE and trace.events.dtype == EVENT_DTYPE
    assert trace.tenant_names == ["a", "b"]
    assert (trace.mode, trace.duration_ns, trace.settle_ns, trace.window_ns, trace.sample_ns) == \
        ("virtual", 3 * SECOND, SECOND, SECOND, 100 * MS)
    assert len(trace.samples) == 60
    a = trace.samples[trace.samples["tenant"] == 0]
    assert a["t_ns"][0] == 100 * MS and a["busy_ns"][-1] == (20 + 30 + 40) * 10 * MS
    assert a["memory_bytes"].max() == GIB
    assert trace.gpu[0]["util_percent"] == 100
    assert list(trace.events["ev"]) == ["process", "process", "oom", "exit"]
    oom = trace.events[trace.events["ev"] == "oom"][0]
    assert (oom["tenant"], oom["bytes"], oom["pid"]) == (0, 8 * GIB, -1)
    assert trace.events[trace.events["ev"] == "process"]["pid"].tolist() == [11, 12]
    assert trace.leaked_bytes == 0

    samples = trace.samples_frame()
    assert list(samples.columns) == ["t_ns", "tenant", "tenant_index", "device", "busy_ns", "memory_bytes", "t_s"]
    assert set(samples["tenant"]) == {"a", "b"}
    events = trace.events_frame()
    assert events.loc[events["ev"] == "exit", "status"].tolist() == ["oom"]
    assert events.loc[events["ev"] == "exit", "tenant"].tolist() == ["a"]
    assert trace.gpu_frame()["memory_used_bytes"].tolist() == [2 * GIB]
    assert trace.tenants_frame()["cores_percent"].tolist() == [30, 70]


def test_shares_per_window_and_per_sample():
    trace = parse_trace(two_tenants().text())
    windows = trace.window_shares()
    assert list(windows.columns) == ["tenant", "tenant_index", "period", "start_ns", "end_ns", "busy_ns", "share",
                                     "share_percent", "complete"]
    a = windows[windows["tenant"] == "a"]
    assert a["share_percent"].tolist() == pytest.approx([20, 30, 40])
    assert a["start_ns"].tolist() == [0, SECOND, 2 * SECOND]
    assert a["complete"].all()
    b = windows[windows["tenant"] == "b"]
    assert b["share"].tolist() == pytest.approx([0.8, 0.7, 0.6])
    per_sample = trace.sample_shares()
    assert len(per_sample) == 2 * 30
    a = per_sample[per_sample["tenant"] == "a"]
    assert a["share_percent"].tolist() == pytest.approx([20] * 10 + [30] * 10 + [40] * 10)
    # Any period: 1.5 s halves.
    halves = trace.shares(1500 * MS)
    assert halves[halves["tenant"] == "a"]["share_percent"].tolist() == pytest.approx([(20 + 15) / 1.5, (15 + 40) / 1.5])


def test_live_samples_off_the_grid_are_interpolated():
    # Samples a little late (live): busy grows at exactly 50 % of wall time, so every window reads 50.
    lines = [{"ev": "run", "scenario": "s", "mode": "live", "duration_ns": 2 * SECOND, "settle_ns": 0,
              "window_ns": SECOND, "sample_ns": 100 * MS},
             {"ev": "tenant", "tenant": "a", "index": 0, "cores_percent": 50}]
    for k in range(1, 21):
        t = k * 100 * MS + (k * 7919) % 3000 * 1000   # 0 .. 3 ms late
        lines.append({"ev": "sample", "t_ns": t, "tenant": "a", "device": 0, "busy_ns": t // 2, "memory_bytes": 0})
    trace = parse_trace("\n".join(json.dumps(line) for line in lines))
    windows = trace.window_shares()
    assert windows["share_percent"].tolist() == pytest.approx([50, 50])
    assert windows["complete"].all()
    assert trace.busy_at("a", 0, [0, 50 * MS]).tolist() == pytest.approx([0, 25 * MS])


def test_tenant_on_two_devices():
    writer = TraceWriter(duration_ns=2 * SECOND).tenant("a", cores=50, devices=(0, 1)).tenant("b", devices=(1,))
    writer.window_shares("a", [40, 60], device=0).window_shares("a", [20, 20], device=1)
    writer.window_shares("b", [10, 10], device=1).end()
    trace = parse_trace(writer.text())
    assert trace.devices_of(0) == [0, 1]
    per_device = trace.window_shares(per_device=True)
    a = per_device[per_device["tenant"] == "a"]
    assert a["device"].tolist() == [0, 0, 1, 1]
    assert a["share_percent"].tolist() == pytest.approx([40, 60, 20, 20])
    combined = trace.window_shares()
    assert combined[combined["tenant"] == "a"]["share_percent"].tolist() == pytest.approx([30, 40])
    assert combined[combined["tenant"] == "b"]["share_percent"].tolist() == pytest.approx([10, 10])


def test_a_cut_short_trace_marks_its_last_windows_incomplete():
    writer = TraceWriter(duration_ns=3 * SECOND).tenant("a").window_shares("a", [50, 50, 50], until_ns=1500 * MS)
    trace = parse_trace(writer.text())
    assert trace.end is None and trace.leaked_bytes is None
    assert trace.window_shares()["complete"].tolist() == [True, False, False]


def test_tenants_named_only_by_samples_still_count():
    text = "\n".join(json.dumps(line) for line in [
        {"ev": "run", "scenario": "s", "duration_ns": SECOND, "window_ns": SECOND, "sample_ns": 500 * MS},
        {"ev": "sample", "t_ns": 500 * MS, "tenant": "x", "device": 0, "busy_ns": 100 * MS, "memory_bytes": 0},
        {"ev": "sample", "t_ns": SECOND, "tenant": "x", "device": 0, "busy_ns": 200 * MS, "memory_bytes": 0},
        {"ev": "future-kind", "t_ns": 0}])
    trace = parse_trace(text)
    assert trace.tenant_names == ["x"]
    assert trace.window_shares()["share_percent"].tolist() == pytest.approx([20])
    assert trace.unknown == [{"ev": "future-kind", "t_ns": 0}]


def test_empty_trace():
    trace = parse_trace("")
    assert len(trace.samples) == 0 and trace.tenant_names == []
    assert trace.window_shares().empty
    assert trace.samples_frame().empty and trace.events_frame().empty


@pytest.mark.parametrize(("text", "message"), [
    ('{"ev":"run"}\nnot json\n', "t.jsonl:2: not a JSON line"),
    ('[1, 2]\n', "t.jsonl:1: not a trace event"),
    ('{"ev":"sample","t_ns":1,"tenant":"a"}\n', "t.jsonl:1: a 'sample' event with a missing or bad field (no 'busy_ns')"),
    ('{"ev":"oom","tenant":"a"}\n', "t.jsonl:1: a 'oom' event with a missing or bad field (no 't_ns')"),
])
def test_bad_lines_are_named(tmp_path, text, message):
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    with pytest.raises(TraceError) as error:
        read_trace(path)
    assert message in str(error.value)


def test_sample_arrays_are_numpy():
    trace = parse_trace(two_tenants().text())
    assert isinstance(trace.samples, np.ndarray)
    assert trace.samples["busy_ns"].dtype == np.int64
