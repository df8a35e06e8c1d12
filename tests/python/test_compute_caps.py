"""Compute caps live over fakecuda: real tenant processes under the real shim (LD_PRELOAD=libvgpu.so) achieve their
GPU-time shares, from their own throughput and from the device's trace."""

from __future__ import annotations

import json
import time

import pytest

from fakegpu_harness import kernel_shares, read_trace


def contain(fake_gpu, shim_path, name: str, percent: int) -> None:
    """Makes the next processes started by `fake_gpu` one container capped at `percent` (force policy)."""
    fake_gpu.env.update({
        "LD_PRELOAD": str(shim_path),
        "CUDA_DEVICE_SM_LIMIT": str(percent),
        "GPU_CORE_UTILIZATION_POLICY": "force",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(fake_gpu.work_dir / f"{name}.region"),
    })


def tenant_share(fake_gpu, *args: str, timeout: float = 60):
    """Runs vgpu-tenant with `args` (fakecuda tracing), and returns its share of the device by the trace and its
    result."""
    trace_path = fake_gpu.enable_trace()
    result = fake_gpu.tenant(*args, timeout=timeout)
    assert result.returncode == 0, result.describe()
    return kernel_shares(read_trace(trace_path), [result.pid]).share(result.pid), result


@pytest.mark.parametrize("kernel_args", [["--kernel-us", "1000"], ["--kernel-us", "20000", "--blocks", "132"],
                                         ["--kernel-us", "20", "--depth", "8"]],
                         ids=["1ms", "persistent-20ms", "20us"])
def test_a_lone_tenant_capped_at_30_percent_gets_30_percent(fake_gpu, tenant_available, shim_path, kernel_args):
    """The short-kernel case is 20 us, not the 5 us of the H100 run: over fakecuda each launch costs the host
    ~12 us on this 2-core machine (5 us kernels kept the fake device only ~40 % busy uncapped, and a slower CI
    machine got 22.8 % under a 30 % cap with the cap never binding); 20 us kernels keep it ~99 % busy uncapped."""
    trace_path = fake_gpu.enable_trace()
    contain(fake_gpu, shim_path, "alone", 30)
    result = fake_gpu.tenant("--seconds", "4", *kernel_args, timeout=60)
    assert result.returncode == 0, result.describe()
    line = result.json
    # The device's view: the tenant's kernels occupied 30 % of the time it ran.
    shares = kernel_shares(read_trace(trace_path), [result.pid])
    print(f"\nlone tenant capped at 30 %, {' '.join(kernel_args)}: own {100 * line['busy_fraction']:.1f} %, "
          f"device trace {100 * shares.share(result.pid):.1f} %")
    assert abs(line["busy_fraction"] - 0.30) <= 0.03, line
    assert abs(shares.share(result.pid) - 0.30) <= 0.03, shares.share(result.pid)


def test_a_kernel_whose_run_time_depends_on_its_data_is_held_to_its_cap(fake_gpu, tenant_available, shim_path):
    """One kernel (one function, one shape) that usually runs 50 us and one launch in eight runs 1 ms, as a kernel
    whose work depends on its input would: the shim cannot know which launch is long. Launches queued back to back
    are measured in windows (every launch inside one), the others settled at the mean of the measured ones, so the
    long runs hide nowhere. Before (unmeasured launches settled at the median, 50 us): the device trace gave this
    tenant several times its 30 % (docs/threat-model.md, "Kernels whose run time depends on their data")."""
    trace_path = fake_gpu.enable_trace()
    contain(fake_gpu, shim_path, "data", 30)
    result = fake_gpu.tenant("--seconds", "4", "--phase", "kernels=" + "|".join(["50us"] * 7 + ["1ms"]) + ",depth=8",
                             timeout=60)
    assert result.returncode == 0, result.describe()
    share = kernel_shares(read_trace(trace_path), [result.pid]).share(result.pid)
    print(f"\ndata-dependent kernel (50 us, 1 ms one launch in 8) capped at 30 %: own "
          f"{100 * result.json['busy_fraction']:.1f} %, device trace {100 * share:.1f} %")
    assert share <= 0.33, f"the long runs escaped the cap: {100 * share:.1f} % of the device for a 30 % cap"
    assert share >= 0.25, f"over-charged: {100 * share:.1f} % for a 30 % cap"


def test_a_deep_queue_is_measured_in_windows_not_launch_by_launch(fake_gpu, tenant_available, shim_path):
    """Measured but never held (the `disable` policy: what a cap that does not bind costs), over a deep queue of
    500 us kernels: after the first launches of a kernel (measured one by one while its cost is unknown), launches
    queued behind running work share measurement windows (5 ms of work each), one event between windows, instead of
    a pair of events around each launch. On the H100 an event record costs the host ~1 us of a ~3 us launch
    (tests/gpu/call_costs.cu). Counted from fakecuda's record of the calls (a 1 us delay rule on each logs every
    call, and slows the host: kernels this long keep the queue deep all the same)."""
    log_path = fake_gpu.work_dir / "calls.jsonl"
    fake_gpu.env.update({"FAKECUDA_FAULTS": "cuEventRecord:delay_us=1;cuLaunchKernel:delay_us=1",
                         "FAKECUDA_FAULT_LOG": str(log_path)})
    contain(fake_gpu, shim_path, "deep", 99)
    fake_gpu.env["GPU_CORE_UTILIZATION_POLICY"] = "disable"
    result = fake_gpu.tenant("--seconds", "3", "--kernel-us", "500", "--depth", "64", timeout=60)
    assert result.returncode == 0, result.describe()
    calls = {"cuEventRecord": 0, "cuLaunchKernel": 0}
    for text in log_path.read_text().splitlines():
        line = json.loads(text)
        if line["pid"] == result.pid and line["call"] in calls:
            calls[line["call"]] += 1
    launches = calls["cuLaunchKernel"]
    shim_records = calls["cuEventRecord"] - launches  # vgpu-tenant records one event after each of its kernels
    print(f"\ndeep queue, measured only: {launches} launches, {shim_records} event records by the shim "
          f"({shim_records / max(launches, 1):.3f} per launch)")
    assert launches > 1000, calls
    assert shim_records <= launches / 2, f"{shim_records} records for {launches} launches: not measured in windows"


def test_launch_bound_tiny_kernels_are_charged_their_gpu_time_not_the_launch_call(fake_gpu, tenant_available, shim_path):
    """A launch-bound stream of short kernels, as PyTorch's `x.add_` on the H100: each launch call takes the host longer
    than the kernel runs (FAKECUDA_LAUNCH_CALL_NS: the call's host time before the GPU has the kernel, ~3 us on the
    H100), so the stream is idle at every launch. A measured launch's event pair then also timed the call (the start is
    written at once, the kernel waits for the call): such a tenant was charged 2-3 times its kernels and held far under
    its cap (H100: `x.add_` at 30 % got 14.3 % of NVML's time). Its pairs are now gated (gates.h): the start waits for
    the host to say the call has returned. 10 us kernels, 15 us launch calls, capped at 15 %: the device trace gives it
    15 %; before, about 6 %."""
    fake_gpu.env["FAKECUDA_LAUNCH_CALL_NS"] = "15000"
    natural_share, _ = tenant_share(fake_gpu, "--seconds", "2", "--kernel-us", "10", "--depth", "64")
    contain(fake_gpu, shim_path, "launch-bound", 15)
    share, _ = tenant_share(fake_gpu, "--seconds", "4", "--kernel-us", "10", "--depth", "64")
    print(f"\nlaunch-bound 10 us kernels (15 us launch calls): uncapped {100 * natural_share:.1f} %, capped at 15 %: "
          f"device trace {100 * share:.1f} %")
    assert natural_share >= 0.22, f"uncapped it takes {100 * natural_share:.1f} %: the cap would not bind"
    assert share <= 0.18, f"{100 * share:.1f} % of the device for a 15 % cap"
    assert share >= 0.12, f"over-charged: {100 * share:.1f} % for a 15 % cap (its launch calls are counted)"


def test_a_kernels_first_launch_that_loads_its_module_does_not_set_its_cost(fake_gpu, tenant_available, shim_path):
    """A real driver loads a kernel's module lazily, inside its first launch call: that launch's event pair also times
    the loading (1.5-3.1 ms for PyTorch's first kernels on the H100, against a few microseconds of kernel). Learned,
    it sat in the kernel's mean for its next 64 measurements, and a tenant measured one launch in 64 at a 10 % cap
    settled every launch at ~300 us: x.add_ got 1.7 % of NVML's time at 10 % on the H100, 0.2 % here. The first
    launch is charged what it measured and not learned from. 10 us kernels, 15 us launch calls, a 5 ms load, 10 %."""
    fake_gpu.env.update({"FAKECUDA_LAUNCH_CALL_NS": "15000", "FAKECUDA_LAZY_LOAD_NS": "5000000"})
    contain(fake_gpu, shim_path, "lazy-load", 10)
    share, _ = tenant_share(fake_gpu, "--seconds", "3", "--kernel-us", "10", "--depth", "64")
    print(f"\nfirst launch loading its module for 5 ms, 10 us kernels capped at 10 %: device trace {100 * share:.1f} %")
    assert share <= 0.12, f"{100 * share:.1f} % of the device for a 10 % cap"
    assert share >= 0.08, f"over-charged: {100 * share:.1f} % for a 10 % cap (the loading set the kernel's cost)"


def test_a_launch_call_that_waits_for_its_gated_stream_does_not_hang(fake_gpu, tenant_available, shim_path):
    """A gate holds a measured launch's stream until the host writes a word after the launch call: a launch call that
    itself waits for that stream (a real driver's may: room in a push buffer shared with the stalled stream, lazy
    module loading) would wait forever for a word nobody writes. The watchdog writes it once it has not moved for
    5-10 ms, and pauses gates (ever longer). FAKECUDA_LAUNCH_WAITS_FOR_STREAM=1 makes every launch call wait for its
    stream: without the watchdog the first gated launch never returns. The run ends, and the cap holds."""
    fake_gpu.env["FAKECUDA_LAUNCH_WAITS_FOR_STREAM"] = "1"
    contain(fake_gpu, shim_path, "waiting-launch", 30)
    share, result = tenant_share(fake_gpu, "--seconds", "2", "--kernel-us", "50", "--depth", "4", timeout=30)
    print(f"\nlaunch calls that wait for their stream, capped at 30 %: {result.json['kernels']} kernels, device trace "
          f"{100 * share:.1f} %")
    assert result.json["kernels"] > 1000, result.json
    assert share <= 0.33, f"{100 * share:.1f} % of the device for a 30 % cap"


def bursts(fake_gpu, work: str, idle: str) -> tuple[float, dict]:
    """Runs vgpu-tenant in bursts (`work`: a phase spec) separated by idle pauses with no synchronize, for 4 s; its
    share of the device by the trace, and its result line."""
    trace_path = fake_gpu.enable_trace()
    result = fake_gpu.tenant("--seconds", "4", "--phase", work, "--phase", f"idle={idle}", "--repeat", timeout=60)
    assert result.returncode == 0, result.describe()
    return kernel_shares(read_trace(trace_path), [result.pid]).share(result.pid), result.json


def test_bursts_that_stop_without_waiting_are_held_to_the_cap(fake_gpu, tenant_available, shim_path):
    """Bursts of queued 200 us kernels (6 ms of launching, 16 in flight), each followed by a 4 ms pause with no
    synchronize: they want ~65 % of the GPU; capped at 30 % they get 30 %."""
    contain(fake_gpu, shim_path, "bursts", 30)
    share, line = bursts(fake_gpu, "kernels=200us,for=6ms,depth=16", "4ms")
    print(f"\nbursts capped at 30 %: own {100 * line['busy_fraction']:.1f} %, device trace {100 * share:.1f} %")
    assert abs(share - 0.30) <= 0.03, f"{100 * share:.1f} % of the device for a 30 % cap"


def test_bursts_under_their_cap_are_not_charged_their_pauses(fake_gpu, tenant_available, shim_path):
    """Bursts of queued 200 us kernels (1 ms of launching, 5 in flight), each followed by a 7 ms pause with no
    synchronize, under a cap they do not reach (40 %): a burst's measurement window is still open when the process
    stops launching, and is closed by the next burst's first launch, after the stream has drained; it is charged its
    GPU time up to its last launch, or its estimates, never the pause. The process gets what it gets uncapped; a
    window charged its pause would count the whole wall time as the process's and hold it far under that."""
    natural, _ = bursts(fake_gpu, "kernels=200us,for=1ms,depth=5", "7ms")
    contain(fake_gpu, shim_path, "bursts", 40)
    share, line = bursts(fake_gpu, "kernels=200us,for=1ms,depth=5", "7ms")
    print(f"\nbursts under a 40 % cap: uncapped {100 * natural:.1f} %, capped: own {100 * line['busy_fraction']:.1f} %, "
          f"device trace {100 * share:.1f} %")
    assert natural < 0.35, f"the workload wants {100 * natural:.1f} %: not under the cap, the test proves nothing"
    assert abs(share - natural) <= 0.02, f"{100 * share:.1f} % capped against {100 * natural:.1f} % uncapped"


KNOWN_GAP = ("kernels longer than a time slice are stretched by the other container's slices, and CUDA events "
             "count those slices: both containers are charged for them (docs/compute-limit.md, 'What is not held')")


@pytest.mark.parametrize("kernel_args", [
    ["--kernel-us", "1000"],
    pytest.param(["--kernel-us", "20000", "--blocks", "132"], marks=pytest.mark.xfail(strict=True, reason=KNOWN_GAP)),
], ids=["1ms", "persistent-20ms"])
def test_two_containers_capped_30_and_70_get_30_and_70(fake_gpu, tenant_available, shim_path, kernel_args):
    """On an ideal device (2 ms slices, free handovers) the limiter gives out the whole GPU. The calibrated device
    cannot (handovers cost ~5 % of it): see the 30/60 test below and scenarios/thirty-seventy.yaml."""
    ideal_device(fake_gpu)
    trace_path = fake_gpu.enable_trace()
    contain(fake_gpu, shim_path, "thirty", 30)
    low = fake_gpu.start_tenant("--seconds", "5", *kernel_args)
    contain(fake_gpu, shim_path, "seventy", 70)
    high = fake_gpu.start_tenant("--seconds", "5", *kernel_args)
    low_line, high_line = low.finish(timeout=60).json, high.finish(timeout=60).json
    shares = kernel_shares(read_trace(trace_path), [low.pid, high.pid])
    print(f"\n30/70, {' '.join(kernel_args)}: own {100 * low_line['busy_fraction']:.1f} / "
          f"{100 * high_line['busy_fraction']:.1f} %, device trace {100 * shares.share(low.pid):.1f} / "
          f"{100 * shares.share(high.pid):.1f} %")
    assert abs(low_line["busy_fraction"] - 0.30) <= 0.03, low_line
    assert abs(high_line["busy_fraction"] - 0.70) <= 0.03, high_line
    assert abs(shares.share(low.pid) - 0.30) <= 0.03, shares.share(low.pid)
    assert abs(shares.share(high.pid) - 0.70) <= 0.03, shares.share(high.pid)


def test_two_containers_capped_30_and_60_on_the_calibrated_device_get_30_and_60(fake_gpu, tenant_available,
                                                                                shim_path):
    """The device as measured on an H100 (2.1 ms slices, 160 us handovers, fakecuda's defaults): caps that leave the
    handovers room hold."""
    trace_path = fake_gpu.enable_trace()
    contain(fake_gpu, shim_path, "thirty", 30)
    low = fake_gpu.start_tenant("--seconds", "5", "--kernel-us", "1000")
    contain(fake_gpu, shim_path, "sixty", 60)
    high = fake_gpu.start_tenant("--seconds", "5", "--kernel-us", "1000")
    low_line, high_line = low.finish(timeout=60).json, high.finish(timeout=60).json
    shares = kernel_shares(read_trace(trace_path), [low.pid, high.pid])
    print(f"\n30/60 on the calibrated device: own {100 * low_line['busy_fraction']:.1f} / "
          f"{100 * high_line['busy_fraction']:.1f} %, device trace {100 * shares.share(low.pid):.1f} / "
          f"{100 * shares.share(high.pid):.1f} %")
    assert abs(shares.share(low.pid) - 0.30) <= 0.03, shares.share(low.pid)
    assert abs(shares.share(high.pid) - 0.60) <= 0.03, shares.share(high.pid)


def ideal_device(fake_gpu) -> None:
    """fakecuda with 2 ms slices and free handovers between processes, in place of the calibrated H100 figures."""
    fake_gpu.env.update({"FAKECUDA_TIMESLICE_US": "2000", "FAKECUDA_SWITCH_US": "0"})


def test_no_limit_leaves_a_tenant_the_whole_device(fake_gpu, tenant_available, shim_path):
    fake_gpu.env.update({"LD_PRELOAD": str(shim_path),
                         "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(fake_gpu.work_dir / "free.region")})
    line = fake_gpu.tenant("--seconds", "2", "--kernel-us", "1000", timeout=60).json
    assert line["busy_fraction"] >= 0.95, line


def test_launches_into_a_capturing_stream_are_left_to_the_graph_launch(fake_gpu, shim_path):
    # Regression (review): the limiter queried and recorded events on every launch, which in a capturing stream
    # records extra nodes or invalidates the capture. Captured launches run nothing: the graph launch is admitted.
    contain(fake_gpu, shim_path, "capture", 50)
    report = fake_gpu.run_py("""
        import time
        from cuda.bindings import driver
        from clientlib import check, cuda_context, emit, launch_spin, load_spin_kernel
        cuda_context(0)
        _, function = load_spin_kernel()
        stream = check("cuStreamCreate", driver.cuStreamCreate(1))
        check("cuStreamBeginCapture", driver.cuStreamBeginCapture(stream, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
        for _ in range(3):
            launch_spin(function, 10_000_000, stream=stream)
        graph = check("cuStreamEndCapture", driver.cuStreamEndCapture(stream))
        nodes = check("cuGraphGetNodes", driver.cuGraphGetNodes(graph, 0))
        node_count = nodes[1] if isinstance(nodes, tuple) else nodes
        executable = check("cuGraphInstantiate", driver.cuGraphInstantiate(graph, 0))
        started = time.monotonic()
        for _ in range(10):
            check("cuGraphLaunch", driver.cuGraphLaunch(executable, stream))
        check("cuStreamSynchronize", driver.cuStreamSynchronize(stream))
        emit({"nodes": node_count, "seconds": time.monotonic() - started})
    """, timeout=60)
    line = report.json
    assert line["nodes"] == 3, line
    # 10 launches x 30 ms of kernels at a 50 % cap: about 0.6 s of wall time, not 0.3 s.
    assert line["seconds"] >= 0.45, line


def test_a_graph_capture_in_global_mode_survives_a_capped_thread_beside_it(fake_gpu, shim_path):
    """One thread captures a graph in CU_STREAM_CAPTURE_MODE_GLOBAL (PyTorch's default) while another thread of the
    process launches under a compute cap. In global mode a "potentially unsafe" call (an event or stream query) from
    any thread invalidates the capture, and the shim queries events to measure launches: it makes those calls with
    its thread's capture mode relaxed. Regression: on the H100, 24 of 40 PyTorch graph captures failed beside a
    capped thread (0 without the shim; tests/gpu/capture_probe.py); fakecuda models the rule for the queries."""
    contain(fake_gpu, shim_path, "capture-global", 50)
    report = fake_gpu.run_py("""
        import threading, time
        from cuda.bindings import driver
        from clientlib import check, cuda_context, emit, launch_spin, load_spin_kernel
        _, context = cuda_context(0)
        _, function = load_spin_kernel()
        stop = threading.Event()
        launched = [0]

        def busy():
            check("cuCtxSetCurrent", driver.cuCtxSetCurrent(context))
            stream = check("cuStreamCreate", driver.cuStreamCreate(1))
            while not stop.is_set():
                launch_spin(function, 200_000, stream=stream)
                launched[0] += 1

        worker = threading.Thread(target=busy)
        worker.start()
        time.sleep(0.3)
        capture_stream = check("cuStreamCreate", driver.cuStreamCreate(1))
        results = []
        for _ in range(10):
            check("cuStreamBeginCapture", driver.cuStreamBeginCapture(
                capture_stream, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
            launch_spin(function, 1_000_000, stream=capture_stream)
            time.sleep(0.05)  # the other thread launches (and the shim measures) meanwhile
            status, graph = driver.cuStreamEndCapture(capture_stream)
            results.append(int(status))
        stop.set()
        worker.join()
        check("cuCtxSynchronize", driver.cuCtxSynchronize())
        emit({"end_capture": results, "launched": launched[0]})
    """, timeout=60)
    line = report.json
    assert line["launched"] > 20, line
    assert line["end_capture"] == [0] * 10, f"cuStreamEndCapture results {line['end_capture']}: captures invalidated"


def test_threads_launching_into_one_stream_are_held_to_the_cap(fake_gpu, shim_path):
    """Four threads launch into the legacy default stream at once, each a kernel whose run time depends on its data
    (30 us, 2 ms one launch in eight): the stream's measurement windows are planned by one thread and ended by
    another, and a window ends only once the launches planned into it are made (else a kernel launched late would
    run after the window's end event, in no window). A pair whose events another thread's launch fell between
    measures both kernels: it is settled at the kernel's usual cost, not learned from. Regression: counting such pairs
    held this process to 21.5–27.7 % (a kernel's mean learned from pairs that timed other threads' kernels too); the
    shim before the windows gave it 100 %. Held to its 30 % by the device's trace, within the run-to-run noise of a
    kernel measured at random: about 3 points (one deviation) over 4 s (tests/shim/compute_test.cc), which failed this
    test's 4-point bounds about one run in six (34.8 % once in CI, 2026-11-23); over 16 s about 1.5."""
    trace_path = fake_gpu.enable_trace()
    contain(fake_gpu, shim_path, "threads", 30)
    report = fake_gpu.run_py("""
        import random, threading, time
        from cuda.bindings import driver
        from clientlib import check, cuda_context, emit, launch_spin, load_spin_kernel
        _, context = cuda_context(0)
        _, function = load_spin_kernel()
        start_ns = time.monotonic_ns()
        deadline = time.monotonic() + 16.0
        launched = [0] * 4

        def worker(index):
            check("cuCtxSetCurrent", driver.cuCtxSetCurrent(context))
            draw = random.Random(index)
            while time.monotonic() < deadline:
                launch_spin(function, 2_000_000 if draw.randrange(8) == 0 else 30_000, stream=0)
                launched[index] += 1

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        check("cuCtxSynchronize", driver.cuCtxSynchronize())
        emit({"launched": launched, "start_ns": start_ns, "end_ns": time.monotonic_ns()})
    """, timeout=60)
    line = report.json
    events = read_trace(trace_path)
    share = busy_between(events, report.pid, line["start_ns"], line["end_ns"])
    print(f"\nfour threads into one stream, capped at 30 %: {sum(line['launched'])} launches, device trace "
          f"{100 * share:.1f} %")
    assert min(line["launched"]) > 50, line
    assert 0.26 <= share <= 0.34, f"{100 * share:.1f} % of the device for a 30 % cap"


def busy_between(events: list[dict], pid: int, start_ns: int, end_ns: int) -> float:
    """The fraction of [start_ns, end_ns) in which pid's kernels were on the device (1 ms kernels: barely stretched)."""
    intervals = sorted((max(int(e["start_ns"]), start_ns), min(int(e["end_ns"]), end_ns)) for e in events
                       if e.get("ev") == "kernel" and e.get("pid") == pid and int(e["end_ns"]) > start_ns
                       and int(e["start_ns"]) < end_ns)
    busy, reach = 0, start_ns
    for start, end in intervals:
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy / (end_ns - start_ns)


def kernel_span(events: list[dict], pid: int) -> tuple[int, int]:
    kernels = [e for e in events if e.get("ev") == "kernel" and e.get("pid") == pid]
    assert kernels, f"no kernels of pid {pid} in the trace"
    return min(int(e["start_ns"]) for e in kernels), max(int(e["end_ns"]) for e in kernels)


def test_default_policy_lets_a_lone_container_run_free(fake_gpu, tenant_available, shim_path):
    """`default`: nobody else wants the GPU, so a container capped at 30 % runs free (its own busy time compared with
    NVML's over the same sample periods; sim finding 3)."""
    trace_path = fake_gpu.enable_trace()
    contain(fake_gpu, shim_path, "alone", 30)
    fake_gpu.env["GPU_CORE_UTILIZATION_POLICY"] = "default"
    result = fake_gpu.tenant("--seconds", "4", "--kernel-us", "1000", timeout=60)
    assert result.returncode == 0, result.describe()
    events = read_trace(trace_path)
    start, end = kernel_span(events, result.pid)
    after_first_second = busy_between(events, result.pid, start + 1_000_000_000, end)
    print(f"\ndefault policy, lone tenant capped at 30 %: {100 * result.json['busy_fraction']:.1f} % overall, "
          f"{100 * after_first_second:.1f} % after its first second")
    assert after_first_second >= 0.90, after_first_second


def test_default_policy_lends_once_nvml_starts_answering(fake_gpu, tenant_available, shim_path):
    """`default` with NVML failing to start at first (nvmlInit fails twice: a driver still loading): the container is
    held to its share while NVML cannot say who else uses the GPU, and runs free once it can. Before, the shim asked
    nvmlInit once per process: one failure ended lending for good (the container stayed at 30 %)."""
    trace_path = fake_gpu.enable_trace()
    contain(fake_gpu, shim_path, "late-nvml", 30)
    fake_gpu.env["GPU_CORE_UTILIZATION_POLICY"] = "default"
    fake_gpu.env["FAKECUDA_FAULTS"] = "nvmlInit_v2:error=NVML_ERROR_DRIVER_NOT_LOADED:count=2"
    result = fake_gpu.tenant("--seconds", "6", "--kernel-us", "1000", timeout=60)
    assert result.returncode == 0, result.describe()
    events = read_trace(trace_path)
    start, end = kernel_span(events, result.pid)
    first_second = busy_between(events, result.pid, start, start + 1_000_000_000)
    # NVML answers at the latest at the third attempt, ~2.1 s in (attempts are a second apart): judged from 3 s on.
    from_third_second = busy_between(events, result.pid, start + 3_000_000_000, end)
    print(f"\ndefault policy, nvmlInit failing twice: {100 * first_second:.1f} % in the first second, "
          f"{100 * from_third_second:.1f} % from 3 s on")
    assert first_second <= 0.40, first_second  # held while blind (the first failed start of NVML)
    assert from_third_second >= 0.90, from_third_second


def test_default_policy_gives_the_gpu_back_when_another_container_arrives(fake_gpu, tenant_available, shim_path):
    """`default`: the free-running container falls to its share within a second of another container's arrival (a 60 %
    one: with the lender's 30 % that leaves the calibrated device room for its handovers)."""
    trace_path = fake_gpu.enable_trace()
    contain(fake_gpu, shim_path, "lender", 30)
    fake_gpu.env["GPU_CORE_UTILIZATION_POLICY"] = "default"
    lender = fake_gpu.start_tenant("--seconds", "6", "--kernel-us", "1000")
    time.sleep(2)
    contain(fake_gpu, shim_path, "arrival", 60)
    arrival = fake_gpu.start_tenant("--seconds", "3", "--kernel-us", "1000")
    arrival_result, lender_result = arrival.finish(timeout=60), lender.finish(timeout=60)
    assert arrival_result.returncode == 0 and lender_result.returncode == 0
    events = read_trace(trace_path)
    start, end = kernel_span(events, arrival_result.pid)
    lender_share = busy_between(events, lender_result.pid, start + 1_000_000_000, end)
    arrival_share = busy_between(events, arrival_result.pid, start + 1_000_000_000, end)
    print(f"\ndefault 30 % lender, force 60 % arrival: {100 * lender_share:.1f} / {100 * arrival_share:.1f} % "
          f"from 1 s after the arrival")
    assert abs(lender_share - 0.30) <= 0.03, lender_share
    assert abs(arrival_share - 0.60) <= 0.03, arrival_share


def test_one_kernel_of_many_sizes_is_held_to_its_cap(fake_gpu, tenant_available, shim_path):
    """vgpu-tenant's spin kernel launched at sizes 5 us .. 5 ms under one function and shape (as a GEMM dispatcher
    or a variable-length batch does): most launches are not measured, and they must be settled at what such a
    launch costs on average, not at the median (which, for sizes this skewed, is far below the mean)."""
    contain(fake_gpu, shim_path, "mixed", 30)
    result = fake_gpu.tenant("--seconds", "5", "--phase", "kernels=5us|50us|500us|5ms,depth=4", timeout=60)
    assert result.returncode == 0, result.describe()
    line = result.json
    print(f"\nmixed sizes under one function, capped at 30 %: {100 * line['busy_fraction']:.1f} %")
    # Within 5 points, not 3: runs give 31-36 % (an open bias of a few points, docs/compute-limit.md); before the
    # fix, 62 %.
    assert abs(line["busy_fraction"] - 0.30) <= 0.05, line
