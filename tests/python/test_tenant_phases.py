"""vgpu-tenant's phases (--phase, --repeat, --seed), its progress lines (--report-ms) and its out-of-memory result, on
a fake H100 of each test's own: what the scenario runner builds a live process from (docs/scenarios.md)."""

from __future__ import annotations

import json
import statistics

import pytest

MS = 1_000_000
GIB = 1 << 30


def reports_and_result(result) -> tuple[list[dict], dict]:
    """The {"ev":"report"} lines, in order, and the result line (the last line)."""
    assert result.returncode == 0, result.describe()
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert lines, result.describe()
    *reports, final = lines
    assert all(report.get("ev") == "report" for report in reports), result.stdout
    assert final.get("status") == "ok", result.describe()
    assert final["pid"] == result.pid
    return reports, final


def busy_at(reports: list[dict], start_ns: int, t_ms: float) -> int:
    """busy_ns of the report nearest to start + t_ms (reports are due on multiples of the period)."""
    return min(reports, key=lambda report: abs(report["t_ns"] - start_ns - t_ms * MS))["busy_ns"]


def run_start_ns(reports: list[dict], period_ms: int) -> int:
    """Reports are due at start + k x period: the earliest start the first few agree with (each is on time or late)."""
    return min(report["t_ns"] - (index + 1) * period_ms * MS for index, report in enumerate(reports[:5]))


def test_phases_run_in_order_and_an_idle_phase_adds_no_busy_time(fake_gpu, tenant_available):
    reports, final = reports_and_result(fake_gpu.tenant(
        "--phase", "kernels=1ms,for=600ms", "--phase", "idle=600ms", "--phase", "kernels=2ms,depth=1,for=600ms",
        "--seconds", "1.8", "--report-ms", "50", timeout=60))
    start = run_start_ns(reports, 50)
    print(f"\nbusy at 0.5/0.6/0.65/1.2/1.7 s: "
          f"{[busy_at(reports, start, t) / 1e9 for t in (500, 600, 650, 1200, 1700)]} s; result {final}")
    # Alone, a run phase keeps the device busy: ~1 s of kernel time per second.
    first_phase = busy_at(reports, start, 550) - busy_at(reports, start, 100)
    assert 0.8 * 450 * MS <= first_phase <= 1.02 * 450 * MS + 2 * MS, reports
    # Idle: its kernels in flight (2 x 1 ms) drain within the first milliseconds, then nothing grows.
    idle = [report["busy_ns"] for report in reports if 650 * MS <= report["t_ns"] - start <= 1180 * MS]
    assert len(idle) >= 8, reports
    assert len(set(idle)) == 1, f"busy grew while idle: {idle}"
    # The third phase, 2 ms kernels one at a time, runs on schedule after the idle one.
    third_phase = busy_at(reports, start, 1750) - busy_at(reports, start, 1300)
    assert 0.8 * 450 * MS <= third_phase <= 1.02 * 450 * MS + 4 * MS, reports
    assert final["kernel_us"] == 0
    assert final["busy_ns"] == reports[-1]["busy_ns"]
    # 600 ms of 1 ms kernels and 600 ms of 2 ms ones: about 900 kernels.
    assert 700 <= final["kernels"] <= 905, final


def test_repeat_loops_the_phases_until_seconds_ends(fake_gpu, tenant_available):
    reports, final = reports_and_result(fake_gpu.tenant(
        "--phase", "kernels=1ms,for=200ms", "--phase", "idle=200ms", "--repeat", "--seconds", "1.2",
        "--report-ms", "100", timeout=60))
    # Three cycles of 200 ms running and 200 ms idle: 0.6 s of kernels in 1.2 s.
    assert 0.8 * 600 * MS <= final["busy_ns"] <= 606 * MS, final
    assert final["elapsed_s"] >= 1.2, final
    assert abs(final["busy_fraction"] - final["busy_ns"] / 1e9 / final["elapsed_s"]) < 1e-6, final


def test_after_the_last_phase_the_tenant_idles_until_seconds_ends(fake_gpu, tenant_available):
    reports, final = reports_and_result(fake_gpu.tenant(
        "--phase", "kernels=1ms,for=300ms", "--seconds", "1", "--report-ms", "100", timeout=60))
    assert final["elapsed_s"] >= 1.0, final
    assert 0.8 * 300 * MS <= final["busy_ns"] <= 303 * MS, final
    assert reports[-2]["busy_ns"] == final["busy_ns"], "no busy time after the phase ended"


def test_mixed_sizes_average_their_sizes(fake_gpu, tenant_available):
    reports, final = reports_and_result(fake_gpu.tenant(
        "--phase", "kernels=100us|1ms|3ms", "--seconds", "1.5", "--seed", "7", timeout=60))
    assert reports == []
    mean_ns = final["busy_ns"] / final["kernels"]
    expected_ns = (0.1 + 1 + 3) / 3 * MS
    print(f"\nmixed 100us|1ms|3ms: {final['kernels']} kernels, mean {mean_ns / MS:.3f} ms "
          f"(expected {expected_ns / MS:.3f})")
    assert final["kernels"] >= 500, final
    assert abs(mean_ns - expected_ns) <= 0.1 * expected_ns, final
    # Alone and closed loop: the device stays busy.
    assert final["busy_fraction"] >= 0.85, final


def test_jitter_varies_durations_around_the_size(fake_gpu, tenant_available):
    _, final = reports_and_result(fake_gpu.tenant(
        "--phase", "kernels=1ms,jitter=20%", "--kernels", "400", timeout=60))
    mean_ns = final["busy_ns"] / final["kernels"]
    assert final["kernels"] == 400
    assert final["busy_ns"] != 400 * MS, "no kernel varied"
    assert abs(mean_ns - MS) <= 0.03 * MS, final


def test_the_same_seed_draws_the_same_kernels(fake_gpu, tenant_available):
    args = ("--phase", "kernels=10us|20us|30us|40us,jitter=5", "--kernels", "300")
    first = reports_and_result(fake_gpu.tenant(*args, "--seed", "5", timeout=60))[1]
    again = reports_and_result(fake_gpu.tenant(*args, "--seed", "5", timeout=60))[1]
    other = reports_and_result(fake_gpu.tenant(*args, "--seed", "6", timeout=60))[1]
    assert first["busy_ns"] == again["busy_ns"], (first, again)
    assert first["busy_ns"] != other["busy_ns"], (first, other)


def test_report_lines_are_monotonic_about_the_period_apart_and_end_at_the_result(fake_gpu, tenant_available):
    reports, final = reports_and_result(fake_gpu.tenant(
        "--kernel-us", "1000", "--seconds", "1.5", "--report-ms", "100", timeout=60))
    assert set(reports[0]) == {"ev", "t_ns", "kernels", "busy_ns"}, reports[0]
    for earlier, later in zip(reports, reports[1:]):
        assert later["t_ns"] > earlier["t_ns"], reports
        assert later["kernels"] >= earlier["kernels"] and later["busy_ns"] >= earlier["busy_ns"], reports
    # The periodic ones (all but the last, printed when the last kernel has finished) are due every 100 ms.
    periodic = reports[:-1]
    assert 13 <= len(periodic) <= 15, reports
    gaps_ms = [(b["t_ns"] - a["t_ns"]) / MS for a, b in zip(periodic, periodic[1:])]
    assert 95 <= statistics.median(gaps_ms) <= 105, gaps_ms
    assert all(50 <= gap <= 150 for gap in gaps_ms), gaps_ms
    # Alone, 1 ms kernels: ~1 s of busy time per second, and a kernel counts 1 ms.
    growth = (periodic[-1]["busy_ns"] - periodic[0]["busy_ns"]) / (periodic[-1]["t_ns"] - periodic[0]["t_ns"])
    assert 0.85 <= growth <= 1.02, (growth, reports)
    assert all(report["busy_ns"] == report["kernels"] * MS for report in reports), reports
    # The last report is the end: the result line's numbers.
    assert reports[-1]["busy_ns"] == final["busy_ns"] == final["kernels"] * MS, (reports[-1], final)
    assert reports[-1]["kernels"] == final["kernels"]


def test_out_of_memory_at_alloc_gives_status_oom_and_exit_3(fake_gpu, tenant_available):
    result = fake_gpu.tenant("--alloc", "100g", "--phase", "kernels=1ms,for=1s", "--report-ms", "100",
                             timeout=60, check=False)
    assert result.returncode == 3, result.describe()
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"only the result line, no report: {result.stdout}"
    line = lines[0]
    assert line["status"] == "oom", line
    assert line["alloc_bytes"] == 100 * GIB, line
    assert line["error"] == "CUDA_ERROR_OUT_OF_MEMORY" and line["call"] == "cuMemAlloc_v2", line
    assert line["kernels"] == 0 and line["busy_ns"] == 0, line


def test_out_of_memory_under_a_container_memory_limit(fake_gpu, tenant_available):
    shim = fake_gpu.library_dir / "libvgpu.so"
    if not shim.exists():
        pytest.skip(f"{shim} is not built")
    fake_gpu.env.update({
        "LD_PRELOAD": str(shim),
        "CUDA_DEVICE_MEMORY_LIMIT": "1g",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(fake_gpu.work_dir / "limited.region"),
    })
    result = fake_gpu.tenant("--alloc", "2g", "--kernels", "1", timeout=60, check=False)
    assert result.returncode == 3, result.describe()
    assert result.json["status"] == "oom", result.describe()
    assert result.json["alloc_bytes"] == 2 * GIB
    fits = fake_gpu.tenant("--alloc", "256m", "--kernels", "10", timeout=60)
    assert fits.json["status"] == "ok" and fits.json["alloc_bytes"] == 256 << 20, fits.describe()


def test_reports_under_a_compute_cap_grow_at_the_cap(fake_gpu, tenant_available):
    shim = fake_gpu.library_dir / "libvgpu.so"
    if not shim.exists():
        pytest.skip(f"{shim} is not built")
    fake_gpu.env.update({
        "LD_PRELOAD": str(shim),
        "CUDA_DEVICE_SM_LIMIT": "30",
        "GPU_CORE_UTILIZATION_POLICY": "force",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(fake_gpu.work_dir / "capped.region"),
    })
    reports, final = reports_and_result(fake_gpu.tenant(
        "--phase", "kernels=1ms", "--seconds", "2.5", "--report-ms", "100", timeout=60))
    periodic = reports[:-1]
    later = [report for report in periodic if report["t_ns"] - periodic[0]["t_ns"] >= 400 * MS]
    growth = (later[-1]["busy_ns"] - later[0]["busy_ns"]) / (later[-1]["t_ns"] - later[0]["t_ns"])
    print(f"\ncapped at 30 %: reports grow at {growth:.3f} s/s; result {final}")
    assert abs(growth - 0.30) <= 0.03, (growth, reports)


@pytest.mark.parametrize("spec, says", [
    ("kernels=5xs", 'unknown unit "xs"'),
    ("kernels=5", "has no unit"),
    ("kernels=1ms|", 'kernels=""'),
    ("kernels=1ms,depth=0", 'depth="0", which is out of range'),
    ("kernels=1ms,rate=-3", 'rate="-3", which is negative'),
    ("kernels=1ms,jitter=150", 'jitter="150", which is out of range'),
    ("kernels=1ms,speed=2", 'unknown key "speed"'),
    ("kernels=1ms,for=2s,for=3s", "gives for= twice"),
    ("idle=1s,depth=2", "mixes idle= with other keys"),
    ("for=2s", "neither kernels= nor idle="),
    ("", "is empty"),
    ("kernels=1ms,collective=1ms", "has an incomplete collective"),
    ("kernels=1ms,ranks=2", "has an incomplete collective"),
    ("kernels=1ms,collective=1ms,ranks=9", 'ranks="9", which is out of range'),
    ("kernels=1ms,collective=1ms,ranks=2,every=0", 'every="0", which is out of range'),
], ids=["unit", "no-unit", "empty-size", "depth", "rate", "jitter", "key", "twice", "idle-mixed", "no-kernels",
        "empty", "collective-alone", "ranks-alone", "ranks", "every"])
def test_a_bad_phase_is_refused_with_one_line_and_exit_2(fake_gpu, tenant_available, spec, says):
    result = fake_gpu.tenant(f"--phase={spec}", "--seconds", "1", timeout=30, check=False)
    assert result.returncode == 2, result.describe()
    assert result.stdout == "", result.describe()
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f'vgpu-tenant: --phase "{spec}" '), lines[0]
    assert says in lines[0], lines[0]
    assert "e.g. --phase " in lines[0], lines[0]


@pytest.mark.parametrize("args, says", [
    (["--phase", "kernels=1ms"], "neither --seconds nor --kernels is given"),
    (["--phase", "kernels=1ms,for=1s", "--repeat"], "--repeat loops the phases until --seconds ends"),
    (["--kernel-us", "5", "--phase", "kernels=1ms", "--seconds", "1"], "--kernel-us and --phase exclude each other"),
    (["--report-ms", "0", "--seconds", "1"], '--report-ms "0" is out of range'),
    (["--seed", "x", "--seconds", "1"], '--seed "x" is not a whole number'),
    (["--seed", "012", "--seconds", "1"], '--seed "012" has a leading zero'),
    (["--seed", "12x", "--seconds", "1"], '--seed "12x" has trailing characters "x"'),
    (["--seed", "-1", "--seconds", "1"], '--seed "-1" is negative'),
    (["--seed", "18446744073709551616", "--seconds", "1"], "is too large (more than 18446744073709551615)"),
    (["--seconds", "1.5s"], '--seconds "1.5s" has trailing characters "s"'),
    (["--seconds", "1e999"], '--seconds "1e999" is out of the range of a double'),
], ids=["no-end", "repeat-without-seconds", "kernel-us-and-phase", "report-ms", "seed", "seed-leading-zero",
        "seed-trailing", "seed-negative", "seed-too-large", "seconds-trailing", "seconds-out-of-range"])
def test_bad_combinations_are_refused_with_one_line_and_exit_2(fake_gpu, tenant_available, args, says):
    result = fake_gpu.tenant(*args, timeout=30, check=False)
    assert result.returncode == 2, result.describe()
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr
