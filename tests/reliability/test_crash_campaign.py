"""Crash campaign (issue 7): tenant processes under the shim SIGKILLed at random moments, inside the region lock
included, round after round; afterwards the region's accounting is what the survivors hold, nobody waits for ever,
and the fake device has all its memory back.

Three containers share one fake H100, each with its own region file (CUDA_DEVICE_MEMORY_SHARED_CACHE) and its own
HAMi limits (CUDA_DEVICE_MEMORY_LIMIT, CUDA_DEVICE_SM_LIMIT), each running three `vgpu-tenant --churn` processes
that launch kernels and, on another thread, allocate and free device memory in a tight loop: every cuMemAlloc_v2
and cuMemFree_v2 takes the container's region lock (docs/region.md), so a random SIGKILL often lands inside it. A
seeded generator (the seed is printed; VGPU_TEST_SEED=N replays the choices) picks when and whom to kill; every
victim is restarted at once.

How we know kills landed inside the lock: the region header counts the times a locker inherited the robust mutex
from a dead owner (pthread EOWNERDEAD) and repaired the region (`lock_repairs`, read through vgpu._native's
read_region). Nothing but our SIGKILLs ends a tenant, and the final probe takes every container's lock after the
last kill, so the sum over the containers is the number of kills that found a victim holding the lock (a lower
bound by at most the rare repairer that is itself killed between taking the lock and counting).

Sizes are chosen so that nothing may be refused: every container's limit covers all its tenants at their largest
(context + every churn block) plus a probe. A dead tenant's usage is always reaped before an allocation is refused,
so any out-of-memory during the campaign means accounting leaked; the survivors' counters must show none.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fakegpu_harness import BackgroundProcess, parse_last_json_line

REPO_ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("VGPU_BUILD_DIR", str(REPO_ROOT / "build" / "default"))  # where vgpu finds _native (conftest)
if str(REPO_ROOT / "python") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "python"))

import vgpu  # noqa: E402  (after the path is set)

MIB = 1 << 20
CONTEXT_BYTES = 128 * MIB  # what a context costs on this fake machine (FAKECUDA_DEVICES below)
# The spin kernel's module: the driver takes its code page at the kernel's first launch, and the shim counts it as the
# driver's own memory (docs/shim.md, "Memory the driver takes by itself").
MODULE_BYTES = 2 * MIB
DEVICES = "h100-80gb:context=128Mi"

# Churn: one thread per tenant, blocks of 4 KiB .. 8 MiB, at most 8 held: at most 64 MiB per tenant.
CHURN_THREADS, CHURN_MAX, CHURN_HOLD = 1, 8 * MIB, 8
TENANTS_PER_CONTAINER = 3
PROBE_ALLOC = 1 * MIB
# Every tenant at its largest plus a probe, rounded up: nothing may ever be refused (see the module's text).
NEEDED = TENANTS_PER_CONTAINER * (CONTEXT_BYTES + CHURN_THREADS * CHURN_HOLD * CHURN_MAX) + CONTEXT_BYTES + PROBE_ALLOC

ROUNDS = 70
PAIR_KILL_PERCENT = 20  # a round kills two tenants of one container at once, this often
PROBE_EVERY = 20        # rounds between mid-campaign probes (one per container)
PROBE_BOUND_S = 10.0    # init + alloc + launches + sync of a fresh process; the region lock's own cap is 10 s
CALL_BOUND_US = 5_000_000

NVML_USED = """
import pynvml
from clientlib import emit
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
emit({"processes": len(pynvml.nvmlDeviceGetComputeRunningProcesses(handle)),
      "used": pynvml.nvmlDeviceGetMemoryInfo(handle).used})
"""


def campaign_seed() -> int:
    text = os.environ.get("VGPU_TEST_SEED")
    seed = int(text, 0) if text else int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed} (VGPU_TEST_SEED={seed} replays the choices)", flush=True)
    return seed


def native():
    try:
        return vgpu.native()
    except vgpu.NativeUnavailable as error:
        pytest.skip(f"the region is read through vgpu._native: {error}")


@dataclass
class Container:
    name: str
    memory_limit: int
    sm_limit: int
    region: Path
    env: dict[str, str]
    tenants: list["Tenant"] = field(default_factory=list)


class Tenant:
    """One `vgpu-tenant --churn` process: its stdout lines, its latest report, pause/resume/stop on stdin."""

    def __init__(self, container: Container, number: int, work_dir: Path, build_dir: Path, seed: int):
        self.container = container
        self.number = number
        argv = [str(build_dir / "bin" / "vgpu-tenant"), "--seconds", "600", "--kernel-us", "200", "--depth", "2",
                "--streams", "2", "--report-ms", "100", "--seed", str(seed),
                "--churn", f"threads={CHURN_THREADS},min=4Ki,max={CHURN_MAX},hold={CHURN_HOLD}"]
        self.process = BackgroundProcess(f"tenant {container.name}{number}", argv, container.env,
                                         work_dir / f"stderr-{container.name}{number}.txt")
        self.reports = 0
        self.kernels = 0

    @property
    def pid(self) -> int:
        return self.process.pid

    def line(self, predicate, timeout: float) -> dict:
        """The next stdout JSON line that satisfies `predicate` (report lines seen on the way are noted)."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.process.next_json(max(deadline - time.monotonic(), 0.001))
            if line.get("ev") == "report":
                self.reports += 1
                self.kernels = line["kernels"]
            if predicate(line):
                return line

    def drain_reports(self) -> None:
        """Takes the lines already printed, noting the reports, without waiting. (The harness has no call for that:
        this reads its reader thread's queue as next_json does.)"""
        while not self.process._lines.empty():
            line = self.process._lines.get_nowait()
            if line is None:
                self.process._lines.put(None)  # leave the end for next_json to report
                return
            self.process._all_lines.append(line)
            if line.startswith("{"):
                event = json.loads(line)
                if event.get("ev") == "report":
                    self.reports += 1
                    self.kernels = event["kernels"]

    def command(self, word: str) -> None:
        assert self.process.popen.stdin is not None
        self.process.popen.stdin.write(word + "\n")
        self.process.popen.stdin.flush()

    def churn(self, word: str, timeout: float = 10.0) -> dict:
        """pause or resume; returns the churn line that answers it."""
        self.command(word)
        state = {"pause": "paused", "resume": "running"}[word]
        return self.line(lambda line: line.get("ev") == "churn" and line.get("state") == state, timeout)


def start_containers(fake_gpu, shim_path: Path, work_dir: Path) -> list[Container]:
    specs = [("a", NEEDED + 64 * MIB, 30), ("b", NEEDED + 16 * MIB, 60), ("c", NEEDED, 0)]
    containers = []
    for name, memory_limit, sm_limit in specs:
        env = dict(fake_gpu.env)
        env.update({"LD_PRELOAD": str(shim_path), "CUDA_DEVICE_MEMORY_LIMIT": str(memory_limit),
                    "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(work_dir / f"{name}.region"),
                    "GPU_CORE_UTILIZATION_POLICY": "force"})
        if sm_limit:
            env["CUDA_DEVICE_SM_LIMIT"] = str(sm_limit)
        containers.append(Container(name, memory_limit, sm_limit, work_dir / f"{name}.region", env))
    return containers


def probe(container: Container, build_dir: Path) -> float:
    """A fresh process of the container: init, alloc, 20 launches, sync, exit. Returns its wall time."""
    started = time.monotonic()
    try:
        result = subprocess.run([str(build_dir / "bin" / "vgpu-tenant"), "--kernels", "20", "--kernel-us", "100",
                                 "--alloc", str(PROBE_ALLOC)], env=container.env, stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=PROBE_BOUND_S * 3)
    except subprocess.TimeoutExpired as expired:
        raise AssertionError(f"a probe of container {container.name} did not finish in {PROBE_BOUND_S * 3} s: "
                             f"a waiter is stuck? stderr: {expired.stderr!r}") from None
    elapsed = time.monotonic() - started
    assert result.returncode == 0, (f"a probe of container {container.name} failed ({result.returncode}):\n"
                                    f"{result.stdout}\n{result.stderr}")
    assert parse_last_json_line(result.stdout, "probe")["kernels"] == 20
    return elapsed


def threads_of(pid: int) -> set[int]:
    return {int(task) for task in os.listdir(f"/proc/{pid}/task")}


def wait_stopped(pid: int, timeout: float = 2.0) -> None:
    """Returns once every thread of `pid` is stopped (SIGSTOP is delivered asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for tid in threads_of(pid):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                    states.append(stat.read().rpartition(")")[2].split()[0])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue  # a thread that just ended
        if states and all(state in ("T", "t") for state in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} did not stop within {timeout} s: thread states {states}")
        time.sleep(0.0002)


def stop_inside_lock(native_module, container: Container, rng: random.Random, budget_s: float = 1.0) -> Tenant | None:
    """Stops every tenant of the container at random moments until one finds a thread of a tenant holding the
    container's region lock; returns that tenant, left stopped there (the others run again). None if no try within
    the time budget did (every tenant is then running again)."""
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        tenants = [tenant for tenant in container.tenants if tenant.process.popen.poll() is None]
        for tenant in tenants:
            os.kill(tenant.pid, signal.SIGSTOP)
        for tenant in tenants:
            wait_stopped(tenant.pid)
        holder = native_module.read_region(container.region)["lock_holder_tid"]
        found = next((tenant for tenant in tenants if holder != 0 and holder in threads_of(tenant.pid)), None)
        for tenant in tenants:
            if tenant is not found:
                os.kill(tenant.pid, signal.SIGCONT)
        if found is not None:
            return found
        time.sleep(rng.uniform(0, 0.001))
    return None


def nvml_used(fake_gpu) -> dict:
    return fake_gpu.run_py(NVML_USED).json


@pytest.mark.slow
def test_random_sigkills_inside_region_locks_leave_exact_accounting_and_no_stuck_waiter(
        fake_gpu, shim_path, build_dir, tmp_path, figures):
    seed = campaign_seed()
    rng = random.Random(seed)
    native_module = native()
    fake_gpu.env["FAKECUDA_DEVICES"] = DEVICES
    campaign_started = time.monotonic()
    idle = nvml_used(fake_gpu)
    containers = start_containers(fake_gpu, shim_path, tmp_path)
    every_tenant: list[Tenant] = []  # for the teardown: whatever is left is killed
    probe_times: list[float] = []

    def spawn(container: Container, number: int) -> Tenant:
        tenant = Tenant(container, number, tmp_path, build_dir, rng.getrandbits(32))
        every_tenant.append(tenant)
        return tenant

    try:
        # One probe per container first: it measures the context's cost into the region, so that every tenant is
        # then charged the same, known amount.
        for container in containers:
            probe_times.append(probe(container, build_dir))
        for container in containers:
            container.tenants = [spawn(container, number) for number in range(TENANTS_PER_CONTAINER)]
        for container in containers:
            for tenant in container.tenants:
                tenant.line(lambda line: line.get("ev") == "report", 30)

        kills = kills_at_startup = kills_seen_in_lock = 0
        rounds_by_kind = {"random": 0, "lock": 0, "startup": 0}

        def kill_and_restart(container: Container, victims: list[Tenant], round_number: int) -> list[Tenant]:
            nonlocal kills, kills_at_startup
            for victim in victims:
                victim.drain_reports()
                assert victim.process.popen.poll() is None, (
                    f"seed {seed}, round {round_number}: {victim.process.what} ended by itself before its kill:\n"
                    f"{victim.process.stderr_text()}")
                kills_at_startup += victim.reports == 0  # not yet launching: starting, attaching, making its context
            for victim in victims:
                os.kill(victim.pid, signal.SIGKILL)
            fresh = []
            for victim in victims:
                victim.process.popen.wait(timeout=10)
                assert victim.process.popen.returncode == -signal.SIGKILL, victim.process.stderr_text()
                victim.process.kill()  # reaped already: closes its pipes and files
                kills += 1
                container.tenants[victim.number] = spawn(container, victim.number)
                fresh.append(container.tenants[victim.number])
            return fresh

        for round_number in range(ROUNDS):
            time.sleep(rng.uniform(0.02, 0.3))
            container = rng.choice(containers)
            number = rng.randrange(TENANTS_PER_CONTAINER)
            # Three kinds of round: a kill at a random moment (now and then of two tenants at once); a kill at a
            # random moment at which the victim holds the region lock (the container's tenants are stopped at random
            # moments until one is seen holding it, then that one is killed; if none is within a second, a random
            # tenant is); a kill of a tenant just restarted, while it starts (attach, slot claim, context).
            kind = rng.choices(list(rounds_by_kind), weights=[45, 35, 20])[0]
            rounds_by_kind[kind] += 1
            if kind == "random":
                numbers = [number]
                if rng.randrange(100) < PAIR_KILL_PERCENT:
                    numbers.append((number + 1 + rng.randrange(TENANTS_PER_CONTAINER - 1)) % TENANTS_PER_CONTAINER)
                kill_and_restart(container, [container.tenants[n] for n in numbers], round_number)
            elif kind == "lock":
                victim = stop_inside_lock(native_module, container, rng)
                kills_seen_in_lock += victim is not None
                kill_and_restart(container, [victim or container.tenants[number]], round_number)
            else:
                fresh = kill_and_restart(container, [container.tenants[number]], round_number)
                time.sleep(rng.uniform(0, 0.08))
                kill_and_restart(container, fresh, round_number)
            if (round_number + 1) % PROBE_EVERY == 0:
                for each in containers:
                    probe_times.append(probe(each, build_dir))
        rounds_s = time.monotonic() - campaign_started

        # The rounds are over. Per container: pause the churn, let a fresh probe through (its attach reaps every dead
        # slot), then the region must hold exactly what the survivors say they hold.
        mismatches: list[str] = []
        lock_repairs = 0
        worst_call_us = 0
        paused_lines: dict[int, dict] = {}
        for container in containers:
            for tenant in container.tenants:
                # Every survivor got going: a kernel of its completed (its module is loaded and counted).
                tenant.line(lambda line: line.get("ev") == "report" and line.get("kernels", 0) > 0, 30)
                paused_lines[tenant.pid] = tenant.churn("pause")
            probe_times.append(probe(container, build_dir))
            region = native_module.read_region(container.region)
            lock_repairs += region["lock_repairs"]
            device = region["devices"][0]
            live = {slot["pid"]: slot["used_bytes"][0] for slot in region["live"]}
            expected = {tenant.pid: CONTEXT_BYTES + MODULE_BYTES + paused_lines[tenant.pid]["held_bytes"]
                        for tenant in container.tenants}
            if device["context_bytes"] != CONTEXT_BYTES:
                mismatches.append(f"{container.name}: context measured at {device['context_bytes']} bytes")
            if live != expected:
                mismatches.append(f"{container.name}: live slots {live} but the survivors hold {expected}")
            if device["cached_used_bytes"] != sum(expected.values()):
                mismatches.append(f"{container.name}: the region's total is {device['cached_used_bytes']} but the "
                                  f"survivors hold {sum(expected.values())}")
            for tenant in container.tenants:
                line = paused_lines[tenant.pid]
                worst_call_us = max(worst_call_us, line["max_call_us"])
                if line["oom"]:
                    mismatches.append(f"{tenant.process.what} was refused {line['oom']} allocations under a limit "
                                      f"that covers every tenant: usage leaked")
            for tenant in container.tenants:
                tenant.churn("resume")
        assert not mismatches, f"seed {seed}: " + "; ".join(mismatches)

        # Every survivor still makes progress: kernels complete, and its churn goes on (checked at the stop).
        stuck = []
        for container in containers:
            for tenant in container.tenants:
                before = tenant.kernels
                try:
                    tenant.line(lambda line, before=before: line.get("ev") == "report" and line["kernels"] > before, 10)
                except AssertionError as error:
                    stuck.append(f"{tenant.process.what}: no kernel completed in 10 s ({error})")
        assert not stuck, f"seed {seed}: " + "; ".join(stuck)
        assert worst_call_us < CALL_BOUND_US, f"seed {seed}: a survivor's alloc or free took {worst_call_us} us"

        # Stop the survivors cleanly: they free everything and report.
        for container in containers:
            for tenant in container.tenants:
                tenant.command("stop")
        for container in containers:
            for tenant in container.tenants:
                stopped = tenant.line(lambda line: line.get("ev") == "churn" and line.get("state") == "stopped", 30)
                result = tenant.process.finish(timeout=30)
                assert result.returncode == 0, result.describe()
                assert result.json["status"] == "ok", result.describe()
                assert stopped["held_bytes"] == 0
                assert stopped["allocs"] > paused_lines[tenant.pid]["allocs"], (
                    f"seed {seed}: {tenant.process.what} did not allocate after it was resumed: {stopped}")
        for container in containers:
            region = native_module.read_region(container.region)
            assert region["live"] == [], f"seed {seed}: {container.name} still lists {region['live']}"
            assert region["devices"][0]["cached_used_bytes"] == 0, (
                f"seed {seed}: {container.name} still counts {region['devices'][0]['cached_used_bytes']} bytes "
                f"after every process ended")

        # Everybody is gone: the fake device is back to its idle figures (fakecuda reclaims a dead process's memory).
        deadline = time.monotonic() + 5.0
        while True:
            after = nvml_used(fake_gpu)
            if (after["used"] == idle["used"] and after["processes"] == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        leaked_bytes = after["used"] - idle["used"]
        assert after["processes"] == 0, f"seed {seed}: NVML still lists processes: {after}"
        assert leaked_bytes == 0, f"seed {seed}: the device leaked {leaked_bytes / MIB:.1f} MiB: {after} vs {idle}"
    finally:
        for tenant in every_tenant:
            tenant.process.kill()

    wall_s = time.monotonic() - campaign_started
    max_probe_s = max(probe_times)
    print(f"crash campaign: {ROUNDS} rounds {rounds_by_kind}, {kills} kills ({kills_at_startup} while starting), "
          f"{lock_repairs} inside the region lock ({kills_seen_in_lock} of them seen holding it), "
          f"{len(containers)} containers x {TENANTS_PER_CONTAINER} tenants; rounds {rounds_s:.1f} s, "
          f"total {wall_s:.1f} s; probes {len(probe_times)}, slowest {max_probe_s:.2f} s; slowest survivor call "
          f"{worst_call_us / 1000:.1f} ms")
    figures.record("crash", seed=seed, rounds=ROUNDS, kills=kills, kills_inside_lock=lock_repairs,
                   kills_seen_holding_lock=kills_seen_in_lock, kills_at_startup=kills_at_startup,
                   containers=len(containers),
                   tenants=len(containers) * TENANTS_PER_CONTAINER, leaked_bytes=leaked_bytes, stuck=0,
                   accounting_mismatches=0, probes=len(probe_times), max_probe_s=round(max_probe_s, 2),
                   max_call_ms=round(worst_call_us / 1000, 1), wall_s=round(wall_s, 1))
    assert kills >= ROUNDS
    # Each victim seen holding the lock died there: the next locker must have repaired the region, and counted it.
    assert kills_seen_in_lock <= lock_repairs <= kills, (seed, kills_seen_in_lock, lock_repairs, kills)
    assert lock_repairs > 0, f"seed {seed}: no kill landed inside the region lock: the campaign lost its point"
    assert max_probe_s < PROBE_BOUND_S, f"seed {seed}: a probe took {max_probe_s:.1f} s"


# ---- a kill while asleep in the compute limiter ------------------------------------------------------------------

LIMITER_SHARE = 10           # CUDA_DEVICE_SM_LIMIT
LIMITER_KERNEL_US = 20_000   # 20 ms kernels: at 10 % each launch waits ~200 ms per tenant ahead of it
LIMITER_KILLS = 4
CLOCK_NANOSLEEP = 230        # x86_64 syscall number; the shim's precise sleep is clock_nanosleep(MONOTONIC, ABSTIME)


def limiter_sleep_left_ns(pid: int) -> int | None:
    """If a thread of `pid` sleeps in clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, ...) -- the shim's sleep to the
    time the compute budget admits a launch (the tenant's closed loop sleeps no other way, and fakecuda sleeps with
    relative nanosleep) -- how long it has left (-1 if its deadline cannot be read); else None."""
    for tid in threads_of(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall") as file:
                fields = file.read().split()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if len(fields) < 4 or fields[0] != str(CLOCK_NANOSLEEP) or int(fields[1], 16) != 1 or int(fields[2], 16) != 1:
            continue
        try:  # the deadline (struct timespec) the thread sleeps to, read from its memory
            with open(f"/proc/{pid}/mem", "rb") as memory:
                memory.seek(int(fields[3], 16))
                timespec = memory.read(16)
        except OSError:
            return -1
        seconds, nanoseconds = int.from_bytes(timespec[:8], "little"), int.from_bytes(timespec[8:], "little")
        return seconds * 1_000_000_000 + nanoseconds - time.monotonic_ns()
    return None


def busy_between(reports: list[dict], start_ns: int, end_ns: int) -> int:
    """GPU time of the kernels a tenant saw complete in [start_ns, end_ns], from its report lines."""
    inside = [report for report in reports if start_ns <= report["t_ns"] <= end_ns]
    before = [report for report in reports if report["t_ns"] < start_ns]
    first = before[-1]["busy_ns"] if before else 0
    return inside[-1]["busy_ns"] - first if inside else 0


@pytest.mark.slow
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="reads the x86_64 syscall number of clock_nanosleep")
def test_a_tenant_killed_asleep_in_the_compute_limiter_does_not_wedge_the_containers_budget(
        fake_gpu, shim_path, tmp_path, figures):
    native_module = native()
    fake_gpu.env["FAKECUDA_DEVICES"] = DEVICES
    region_path = tmp_path / "limited.region"
    env = dict(fake_gpu.env)
    env.update({"LD_PRELOAD": str(shim_path), "CUDA_DEVICE_SM_LIMIT": str(LIMITER_SHARE),
                "GPU_CORE_UTILIZATION_POLICY": "force", "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region_path)})
    argv = [str(fake_gpu.tenant_path), "--seconds", "120", "--kernel-us", str(LIMITER_KERNEL_US), "--depth", "1",
            "--report-ms", "100"]
    started: list[BackgroundProcess] = []

    def start(name: str) -> BackgroundProcess:
        process = BackgroundProcess(name, argv, env, tmp_path / f"stderr-{name}-{len(started)}.txt")
        started.append(process)
        return process

    def reports_of(process: BackgroundProcess, until_ns: int) -> list[dict]:
        lines = []
        while True:
            line = process.next_json(10)
            if line.get("ev") == "report":
                lines.append(line)
                if line["t_ns"] >= until_ns:
                    return lines

    sleep_left_ms = []
    try:
        survivor = start("survivor")
        victim = start("victim")
        survivor_reports = reports_of(survivor, time.monotonic_ns() + 2_000_000_000)
        for kill in range(LIMITER_KILLS):
            # Catch the victim asleep in the limiter with a launch admitted and charged, then kill it there.
            deadline = time.monotonic() + 10
            while True:
                left = limiter_sleep_left_ns(victim.pid)
                if left is not None and (left == -1 or left > 5_000_000):
                    break
                assert time.monotonic() < deadline, "the victim was never seen asleep in the compute limiter"
                time.sleep(0.001)
            os.kill(victim.pid, signal.SIGKILL)
            last_kill_ns = time.monotonic_ns()
            victim.popen.wait(timeout=10)
            assert victim.popen.returncode == -signal.SIGKILL
            victim.kill()
            sleep_left_ms.append(round(left / 1e6, 1) if left >= 0 else None)
            if kill + 1 < LIMITER_KILLS:
                victim = start("victim")
                time.sleep(0.3)
        # The survivor, alone now, must be back at its share: the dead sleepers' charges cost the container one
        # kernel each (never run, never refunded), not its budget for good.
        settle_ns, window_ns = 1_000_000_000, 3_000_000_000
        survivor_reports += reports_of(survivor, last_kill_ns + settle_ns + window_ns)
        busy_ns = busy_between(survivor_reports, last_kill_ns + settle_ns, last_kill_ns + settle_ns + window_ns)
        first_after = next((report for report in survivor_reports
                            if report["t_ns"] > last_kill_ns and report["kernels"] > max(
                                r["kernels"] for r in survivor_reports if r["t_ns"] <= last_kill_ns)), None)
        region = native_module.read_region(region_path)
        budget_ns = region["devices"][0]["budget_ns"]
    finally:
        for process in started:
            process.kill()
    share = busy_ns / window_ns
    first_kernel_s = (first_after["t_ns"] - last_kill_ns) / 1e9 if first_after else None
    print(f"limiter kills: {LIMITER_KILLS} victims killed asleep in the limiter with {sleep_left_ms} ms left; the "
          f"survivor completed a kernel {first_kernel_s} s after the last kill, then got {share:.1%} of the GPU over "
          f"{window_ns / 1e9:.0f} s (cap {LIMITER_SHARE} %); budget {budget_ns / 1e6:.1f} ms")
    figures.record("crash-limiter", kills=LIMITER_KILLS, kills_asleep_in_limiter=LIMITER_KILLS,
                   sleep_left_ms=sleep_left_ms, survivor_share_percent=round(share * 100, 1),
                   first_kernel_after_kill_s=first_kernel_s, budget_ms_after=round(budget_ns / 1e6, 1))
    assert first_after is not None, "the survivor completed no kernel after the last kill: the budget is wedged"
    assert share >= 0.7 * LIMITER_SHARE / 100, f"the survivor got {share:.1%} of the GPU, its cap is {LIMITER_SHARE} %"
    assert share <= 1.3 * LIMITER_SHARE / 100 + LIMITER_KERNEL_US * 1000 / window_ns, f"over the cap: {share:.1%}"


def test_the_churn_option_refuses_what_it_cannot_read(fake_gpu):
    for spec, expected in [("threads=0", "threads=\"0\", which is out of range"), ("max=3Ki", "max=\"3Ki\""),
                           ("min=8Mi,max=4Mi", "min above max"), ("hold", "without ="), ("size=1", "unknown key")]:
        result = fake_gpu.tenant("--churn", spec, "--kernels", "1", check=False)
        assert result.returncode == 2, result.describe()
        assert expected in result.stderr and "--churn" in result.stderr, result.stderr
