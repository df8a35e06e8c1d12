"""tests/gpu/handovers.py, the timeline of several processes' kernels on one GPU (issue 20, item 1c), checked on
kernels laid out by hand: where the time nobody ran falls (at handovers or inside one process's run), the time two
ran at once, and the first kernel after a handover."""

from __future__ import annotations

import pytest

from test_gpu_measures import load

MS = 1_000_000


@pytest.fixture
def h(monkeypatch):
    return load("handovers", monkeypatch)


def ms(*pairs: tuple[float, float]) -> list[tuple[int, int]]:
    return [(round(s * MS), round(e * MS)) for s, e in pairs]


def test_the_time_nobody_ran_is_split_into_handover_gaps_and_gaps_inside_a_run(h):
    a = ms((0, 1), (1, 2), (2, 3), (6.8, 7.8), (7.8, 10), (11.2, 12))
    b = ms((3.4, 4.4), (4.4, 5.4), (5.5, 6.5), (10.2, 11))
    r = h.analyse([a, b])
    # Judged over the span both ran in, B's first start to B's last end: 3.4 .. 11 ms.
    assert r["span_s"] == pytest.approx(0.0076)
    assert r["share"] == pytest.approx([3.2 / 7.6, 3.8 / 7.6], abs=1e-4)
    assert r["together"] == 0
    # Handovers: B→A at 6.5 (0.3 ms idle), A→B at 10 (0.2); B's own gap 5.4 .. 5.5.
    assert r["handover_gap_ms"] == {"p50": 0.3, "p90": 0.3, "mean": 0.25, "count": 2}
    assert r["idle_at_handovers"] == pytest.approx(0.5 / 7.6, abs=1e-4)
    assert r["idle_inside_runs"] == pytest.approx([0, 0.1 / 7.6], abs=1e-4)
    assert r["own_gap_ms_mean"] == [None, 0.1]
    assert r["idle"] == pytest.approx(0.6 / 7.6, abs=1e-4)
    assert r["handovers_per_s"] == pytest.approx(2 / 0.0076, rel=1e-2)
    # Runs, handover to handover: B's first (from 3.4, the span's start) is left out as cut off; A's 6.8 .. 10 counts.
    assert r["run_ms"][0] == {"p10": 3.2, "p50": 3.2, "p90": 3.2, "mean": 3.2, "count": 1}
    assert r["run_ms"][1]["count"] == 0


def test_two_processes_running_at_once_is_counted_once_as_busy_and_as_together(h):
    r = h.analyse([ms((0, 2), (3, 4)), ms((1, 3.5))])
    # Over the span both ran in, 1..3.5: together 1..2 and 3..3.5.
    assert r["span_s"] == pytest.approx(0.0025)
    assert r["together"] == pytest.approx(1.5 / 2.5)
    assert r["idle"] == pytest.approx(0)
    assert r["handover_gap_ms"]["count"] == 0
    assert r["share"] == pytest.approx([1.5 / 2.5, 1.0])


def test_a_kernel_that_begins_after_another_process_ran_is_counted_as_the_first_after_a_handover(h):
    a = ms((0, 1), (1, 2), (5, 6))
    b = ms((2.5, 4), (4, 4.5))  # its first runs 1.5 ms after A's run, its second 0.5 back to back
    r = h.analyse([a, b])
    assert r["kernel_ms"][1] == {"first_after_handover": 1.5, "count_first": 1, "others": 0.5, "count_others": 1}
    assert r["kernel_ms"][0]["count_first"] == 1  # A's kernel at 5 (after B's); its first at 0 had nothing before


def test_bad_input_is_refused_naming_what_was_wrong(h, tmp_path):
    with pytest.raises(ValueError, match="process 1: a kernel ends"):
        h.analyse([ms((0, 1)), [(5, 4)]])
    with pytest.raises(ValueError, match="at least one kernel"):
        h.analyse([ms((0, 1)), []])
    with pytest.raises(ValueError, match="no common time"):
        h.analyse([ms((0, 1)), ms((2, 3))])
    bad = tmp_path / "k.txt"
    bad.write_text("1 2\n3 4 5\n")
    with pytest.raises(ValueError, match=r"k.txt:2: expected 'start_ns end_ns'"):
        h.read(str(bad))
