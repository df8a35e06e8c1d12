"""The node monitor and the shim's use of its verdict (docs/node-monitor.md, "Failure story"): a verdict is used
only while fresh and while its seq does not go back; a malformed or missing one changes nothing; the monitor writes
what the driver shows per container, reports a container file it cannot read without stopping the others, never
sends a container's seq back across a restart, and refuses bad options naming them.

Run by the reliability suite (tests/reliability/conftest.py): fixtures fake_gpu, node_monitor."""

from __future__ import annotations

import json
import subprocess
import time

from conftest import MONITOR
from test_bypass import GIB, HOLD, contain

UUID_OF_DEVICE_0 = """
from cuda.bindings import driver as cu
cu.cuInit(0)
err, dev = cu.cuDeviceGet(0)
err, uuid = cu.cuDeviceGetUuid(dev)
b = bytes(uuid.bytes)
print('{"uuid": "GPU-%s-%s-%s-%s-%s"}' % (b[0:4].hex(), b[4:6].hex(), b[6:8].hex(), b[8:10].hex(), b[10:16].hex()))
"""

# Allocates 64 MiB after each verdict the test hands it (a line on stdin: the verdict's text, JSON-quoted), written
# by the client itself to VGPU_VERDICT_FILE; prints each allocation's result.
ALLOCATE_PER_VERDICT = """
import json, os, sys, time
from cuda.bindings import driver as cu
assert cu.cuInit(0)[0] == cu.CUresult.CUDA_SUCCESS
err, dev = cu.cuDeviceGet(0)
err, ctx = cu.cuDevicePrimaryCtxRetain(dev)
cu.cuCtxSetCurrent(ctx)
path = os.environ["VGPU_VERDICT_FILE"]
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    with open(path + ".tmp", "w") as f:
        f.write(json.loads(line))
    os.rename(path + ".tmp", path)
    time.sleep(0.02)  # past the shim's 10 ms cache
    err, p = cu.cuMemAlloc(64 << 20)
    if err == cu.CUresult.CUDA_SUCCESS:
        cu.cuMemFree(p)
    print(json.dumps({"alloc": int(err)}), flush=True)
"""


def verdict_text(uuid: str, seq: int, stamp_ns: int, used: int, limit: int = GIB) -> str:
    return (f"vgpu-verdict 1\nseq {seq}\nstamp_ns {stamp_ns}\n"
            f"device {uuid} memory_limit={limit} memory_used={used} sm_limit=0 sm_used=0\n")


def allocations_per_verdict(fake_gpu, tmp_path, verdicts: list[str]) -> list[int]:
    contain(fake_gpu, memory_limit="2Gi")
    fake_gpu.env["VGPU_VERDICT_FILE"] = str(tmp_path / "verdict")
    fake_gpu.env["LIBCUDA_LOG_LEVEL"] = "2"
    client = fake_gpu.start_py(ALLOCATE_PER_VERDICT)
    assert client.next_json(timeout=30) == {"ready": True}
    results = []
    for text in verdicts:
        client.popen.stdin.write(json.dumps(text) + "\n")
        client.popen.stdin.flush()
        results.append(client.next_json(timeout=30)["alloc"])
    result = client.finish(timeout=30)
    assert result.returncode == 0, result.describe()
    return results, result.stderr


def now_ns() -> int:
    return time.time_ns()


def test_a_fresh_verdict_over_the_limit_refuses_what_the_region_allows(fake_gpu, tmp_path):
    uuid = fake_gpu.run_py(UUID_OF_DEVICE_0).json["uuid"]
    results, _ = allocations_per_verdict(fake_gpu, tmp_path, [
        verdict_text(uuid, 1, now_ns(), used=GIB // 2),      # under: allowed
        verdict_text(uuid, 2, now_ns(), used=GIB + 1),       # over: refused (2 = CUDA_ERROR_OUT_OF_MEMORY)
        verdict_text(uuid, 3, now_ns(), used=GIB),           # at the limit: allowed
    ])
    assert results == [0, 2, 0]


def test_a_stale_or_future_verdict_is_not_used(fake_gpu, tmp_path):
    uuid = fake_gpu.run_py(UUID_OF_DEVICE_0).json["uuid"]
    results, stderr = allocations_per_verdict(fake_gpu, tmp_path, [
        verdict_text(uuid, 1, now_ns() - 3 * 10**9, used=2 * GIB),   # 3 s old
        verdict_text(uuid, 2, now_ns() + 3 * 10**9, used=2 * GIB),   # 3 s ahead
        verdict_text(uuid, 3, now_ns(), used=2 * GIB),               # fresh
    ])
    assert results == [0, 0, 2]
    assert "stale" in stderr, stderr


def test_a_verdict_whose_seq_went_back_is_not_used(fake_gpu, tmp_path):
    uuid = fake_gpu.run_py(UUID_OF_DEVICE_0).json["uuid"]
    results, stderr = allocations_per_verdict(fake_gpu, tmp_path, [
        verdict_text(uuid, 100, now_ns(), used=0),
        verdict_text(uuid, 50, now_ns(), used=2 * GIB),     # an old monitor's, say: ignored
        verdict_text(uuid, 101, now_ns(), used=2 * GIB),
    ])
    assert results == [0, 0, 2]
    assert "going back" in stderr, stderr


def test_a_malformed_verdict_is_not_used_and_nothing_crashes(fake_gpu, tmp_path):
    uuid = fake_gpu.run_py(UUID_OF_DEVICE_0).json["uuid"]
    over = verdict_text(uuid, 1, now_ns(), used=2 * GIB)
    results, stderr = allocations_per_verdict(fake_gpu, tmp_path, [
        over[:-1],                                   # cut short
        over.replace("memory_used=", "memory_used=-"),
        "\x00" * 64,
        over.replace(uuid, "GPU-nonsense"),
        verdict_text(uuid, 2, now_ns(), used=2 * GIB),
    ])
    assert results == [0, 0, 0, 0, 2]
    assert "malformed" in stderr, stderr


def test_the_monitor_writes_what_the_driver_shows_for_the_container(fake_gpu, node_monitor):
    contain(fake_gpu, memory_limit="4Gi")
    node_monitor.contain(memory_limit="4Gi", sm_limit=30)
    node_monitor.start(period_ms=50)
    holder = fake_gpu.start_py(HOLD, str(GIB))
    held = holder.next_json(timeout=30)
    line = node_monitor.wait_for(
        lambda: next((l for l in node_monitor.verdict().splitlines() if l.startswith("process ")), None), 10,
        "a process line")
    text = node_monitor.verdict()
    holder.finish(timeout=30)
    device = next(l for l in text.splitlines() if l.startswith("device "))
    fields = dict(word.split("=") for word in device.split()[2:])
    assert int(fields["memory_limit"]) == 4 * GIB
    assert int(fields["sm_limit"]) == 300
    # The driver's count of the process (its context included) is what the shim charged the container for it.
    assert int(fields["memory_used"]) == held["used"], (text, held)
    assert line.startswith(f"process {holder.pid} "), text


def test_a_bad_container_file_is_reported_once_and_the_others_are_still_judged(fake_gpu, node_monitor):
    node_monitor.contain(memory_limit="1Gi")
    (node_monitor.containers / "broken.conf").write_text("VGPU_CGROUP=/x\nCUDA_DEVICE_MEMORY_LIMIT=lots\n")
    node_monitor.start(period_ms=20)
    seq = lambda: int(node_monitor.verdict().splitlines()[1].split()[1])  # noqa: E731
    first = seq()
    node_monitor.wait_for(lambda: seq() >= first + 5 * 20_000_000 or None, 30, "five more periods")
    log = node_monitor.log()
    assert log.count("broken.conf") == 1, log
    assert "CUDA_DEVICE_MEMORY_LIMIT" in log and "lots" in log, log
    assert not (node_monitor.verdicts / "broken").exists()
    assert node_monitor.verdict_path.exists()


def test_a_restarted_monitor_never_sends_a_containers_seq_back(fake_gpu, node_monitor):
    node_monitor.contain(memory_limit="1Gi")
    far_ahead = 2**63
    node_monitor.verdict_path.parent.mkdir(parents=True)
    node_monitor.verdict_path.write_text(f"vgpu-verdict 1\nseq {far_ahead}\nstamp_ns 1\n")
    node_monitor.start(period_ms=20)
    seq = lambda: int(node_monitor.verdict().splitlines()[1].split()[1])  # noqa: E731
    seqs = [node_monitor.wait_for(lambda: seq() if seq() != far_ahead else None, 30, "the restarted monitor's verdict")]
    while len(seqs) < 3:
        seqs.append(node_monitor.wait_for(lambda: seq() if seq() != seqs[-1] else None, 30, "the next verdict"))
    assert seqs[0] > far_ahead and seqs == sorted(seqs) and len(set(seqs)) == 3, seqs


def test_the_monitor_refuses_bad_options_naming_them(tmp_path):
    cases = {("--period-ms", "5"): "--period-ms '5'", ("--action", "shoot"): "--action 'shoot'",
             ("--periods", "0"): "--periods '0'", ("--log-level", "9"): "--log-level '9'",
             ("--colour", "red"): "unknown option '--colour'", ("--containers",): "--containers needs a value"}
    for args, said in cases.items():
        run = subprocess.run([str(MONITOR), *args], capture_output=True, text=True, timeout=30)
        assert run.returncode == 2, (args, run)
        assert said in run.stderr, (args, run.stderr)
    run = subprocess.run([str(MONITOR), "--containers", str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 2 and "--verdicts are required" in run.stderr, run.stderr


def test_nvml_failing_or_answering_garbage_leaves_devices_unjudged_and_the_monitor_running(fake_gpu, node_monitor):
    """The monitor's NVML calls fail or answer garbage (fakecuda's fault injection): it keeps writing verdicts that
    parse, judges the container only on figures that hold (the process list read twice and agreeing, nothing past
    the device's memory), and with --action kill ends nobody over garbage (the container is within its limit)."""
    contain(fake_gpu, memory_limit="4Gi")
    node_monitor.contain(memory_limit="4Gi")
    holder = fake_gpu.start_py(HOLD, str(GIB))
    held = holder.next_json(timeout=30)
    assert held["alloc"] == 0, held
    fake_gpu.env["FAKECUDA_FAULTS"] = ";".join([
        "nvmlDeviceGetComputeRunningProcesses_v3:error=NVML_ERROR_UNKNOWN:prob=0.2",
        "nvmlDeviceGetComputeRunningProcesses_v3:garbage:prob=0.3",
        "nvmlDeviceGetProcessUtilization:error=NVML_ERROR_UNKNOWN:prob=0.5",
        "nvmlDeviceGetMemoryInfo:error=NVML_ERROR_GPU_IS_LOST:prob=0.2",
    ])
    node_monitor.start(action="kill", period_ms=20)
    judged, unjudged, seen = 0, 0, set()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        text = node_monitor.verdict()
        seq = text.splitlines()[1]
        if seq in seen:
            time.sleep(0.005)
            continue
        seen.add(seq)
        assert text.startswith("vgpu-verdict 1\n") and text.endswith("\n"), text
        devices = [line for line in text.splitlines() if line.startswith("device ")]
        if not devices:
            unjudged += 1
            continue
        judged += 1
        fields = dict(word.split("=") for word in devices[0].split()[2:])
        assert int(fields["memory_used"]) == held["used"], f"a device judged on garbage: {text}"
    assert holder.popen.poll() is None, f"the holder was killed: {node_monitor.log()}"
    result = holder.finish(timeout=30)
    assert result.returncode == 0, result.describe()
    assert node_monitor.process.poll() is None, f"the monitor died: {node_monitor.log()}"
    assert "killed" not in node_monitor.log(), node_monitor.log()
    assert judged > 5 and unjudged > 5, (judged, unjudged)
