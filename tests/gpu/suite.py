#!/usr/bin/env python3
"""The GPU suite (issue 6), started by tests/gpu/run.sh after the build: every stage in one run on a GPU machine.

Stages (VGPU_GPU_STAGES picks some): conformance, memory, compute, overhead, fidelity, monitor. After each one the report
is written again (report.json, report.md in --out), so a run cut short still returns what it measured. Every
program it starts has a timeout and its own process group, which is killed when the timeout passes.

This program itself never loads the shim: it is the host's view (NVML through pynvml, nvidia-smi) beside the
workloads it starts under LD_PRELOAD=libvgpu.so.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import glob
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORKLOADS = os.path.join(HERE, "torch_workloads.py")
# A hostile process of a container that keeps the region's compute budget cell full (tests/reliability/test_bypass.py).
CELL_WRITER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "clients", "cell_writer.py")
STAGES = ("conformance", "memory", "compute", "overhead", "fidelity", "monitor")
# Suites whose tests compare free memory or list the GPU's processes: run one test at a time on the real GPU.
SERIAL_SUITES = {"array", "memory", "nvml", "pool", "vmm", "driver_init"}
MIB = 1 << 20


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def log(message: str) -> None:
    print(f"[{datetime.datetime.now(datetime.timezone.utc).strftime('%H:%M:%S')}] {message}", flush=True)


def start(cmd, env=None, cwd=None) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def finish(proc: subprocess.Popen, timeout: float) -> dict:
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc)
        stdout, stderr = proc.communicate()
    return {"rc": proc.returncode, "stdout": stdout, "stderr": stderr, "timed_out": timed_out, "pid": proc.pid}


def run(cmd, env=None, timeout=60.0, cwd=None) -> dict:
    """Runs cmd in its own process group; on timeout the whole group is SIGKILLed."""
    begin = time.time()
    try:
        proc = start(cmd, env=env, cwd=cwd)
    except OSError as failure:
        return {"rc": None, "stdout": "", "stderr": repr(failure), "wall_s": 0.0, "timed_out": False, "pid": None}
    return {**finish(proc, timeout), "wall_s": time.time() - begin}


def json_lines(text: str) -> list[dict]:
    found = []
    for line in (text or "").splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return found


def tail(text: str, n: int = 600) -> str:
    text = (text or "").strip()
    return text[-n:]


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def rnd(value, digits=3):
    return None if value is None else round(value, digits)


# ---- the host's view: NVML (pynvml) and nvidia-smi, outside the shim ---------------------------------------------


class Nvml:
    def __init__(self):
        self.ok = False
        self.error = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.n = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.ok = True
        except Exception as failure:  # noqa: BLE001
            self.error = repr(failure)

    def call(self, name, *args):
        if not self.ok:
            return None
        try:
            return getattr(self.n, name)(*args)
        except Exception:  # noqa: BLE001 - a query the driver (or fakecuda) does not answer
            return None

    def sample(self) -> dict:
        n = self.n
        util = self.call("nvmlDeviceGetUtilizationRates", self.handle)
        power = self.call("nvmlDeviceGetPowerUsage", self.handle)
        return {"t": time.time(), "sm_mhz": self.call("nvmlDeviceGetClockInfo", self.handle, n.NVML_CLOCK_SM),
                "util": None if util is None else util.gpu,
                "power_w": None if power is None else power / 1000.0}

    def processes(self) -> list[tuple[int, int]]:
        found = self.call("nvmlDeviceGetComputeRunningProcesses", self.handle) or []
        return [(p.pid, (p.usedGpuMemory or 0) // MIB) for p in found]


UTIL_LAG_S = 1.0  # NVML's utilization covers up to this much time before each sample


class Sampler(threading.Thread):
    """NVML every `period` s: SM clock, utilization, power; kept with their wall times."""

    def __init__(self, nvml: Nvml, period: float = 0.05):
        super().__init__(daemon=True)
        self.nvml, self.period = nvml, period
        self.samples: list[dict] = []
        self.stopping = threading.Event()

    def run(self):
        while not self.stopping.is_set() and self.nvml.ok:
            self.samples.append(self.nvml.sample())
            self.stopping.wait(self.period)

    def stop(self):
        self.stopping.set()
        self.join(timeout=5)

    def between(self, t0: float, t1: float) -> dict:
        """The samples taken in [t0, t1]. NVML's utilization is the share of its own sampling period (up to 1 s on
        the H100) before the call, so `util_mean` leaves out the first UTIL_LAG_S of the span (where the samples
        reach back before t0: the run's NVML reading was 3-8 points low at 50-90 %, docs/results-gpu.md "Thirteenth
        run"); `util_mean_all` keeps them."""
        chosen = [s for s in self.samples if t0 <= s["t"] <= t1]
        late = [s for s in chosen if s["t"] >= t0 + UTIL_LAG_S] if t1 - t0 > 2 * UTIL_LAG_S else chosen
        return {"sm_mhz_median": median(s["sm_mhz"] for s in chosen),
                "sm_mhz_min": min((s["sm_mhz"] for s in chosen if s["sm_mhz"] is not None), default=None),
                "sm_mhz_max": max((s["sm_mhz"] for s in chosen if s["sm_mhz"] is not None), default=None),
                "util_mean": rnd(mean(s["util"] for s in late), 1),
                "util_mean_all": rnd(mean(s["util"] for s in chosen), 1),
                "power_w_mean": rnd(mean(s["power_w"] for s in chosen), 1), "nvml_samples": len(chosen)}


class AppsSampler(threading.Thread):
    """The host's per-process memory view, as fast as it answers: nvidia-smi --query-compute-apps (or pynvml)."""

    def __init__(self, nvml: Nvml, use_smi: bool):
        super().__init__(daemon=True)
        self.nvml, self.use_smi = nvml, use_smi
        self.rows: list[tuple[float, int, int]] = []  # (time, pid, MiB) from nvidia-smi (else pynvml)
        self.nvml_rows: list[tuple[float, int, int]] = []  # the same from pynvml, beside nvidia-smi
        self.errors = 0
        self.stopping = threading.Event()

    def run(self):
        while not self.stopping.is_set():
            t = time.time()
            if self.use_smi:
                done = run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           timeout=20)
                if done["rc"] != 0:
                    self.errors += 1
                for line in done["stdout"].splitlines():
                    parts = [p.strip() for p in line.split(",")]
                    if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                        self.rows.append((t, int(parts[0]), int(parts[1])))
                for pid, mib in self.nvml.processes():
                    self.nvml_rows.append((time.time(), pid, mib))
            else:
                for pid, mib in self.nvml.processes():
                    self.rows.append((t, pid, mib))
                self.stopping.wait(0.05)

    def stop(self):
        self.stopping.set()
        self.join(timeout=30)


# ---- the suite ------------------------------------------------------------------------------------------------------


class Suite:
    def __init__(self, args):
        self.args = args
        self.build = os.path.abspath(args.build)
        self.out = os.path.abspath(args.out)
        self.fake = bool(os.environ.get("VGPU_GPU_FAKE"))
        self.started = float(os.environ.get("VGPU_GPU_STARTED_S") or time.time())
        self.budget = float(os.environ.get("VGPU_GPU_BUDGET_S") or 520)
        self.point_s = float(os.environ.get("VGPU_GPU_POINT_S") or 3)
        self.shim = os.path.join(self.build, "lib", "libvgpu.so")
        self.tenant = os.path.join(self.build, "bin", "vgpu-tenant")
        self.tmp = tempfile.mkdtemp(prefix="vgpu-gpu-suite.")
        self.nvml = Nvml()
        self.smi = shutil.which("nvidia-smi") is not None and not self.fake
        self.report = {"suite": "vgpu GPU suite (tests/gpu/run.sh)", "report_version": 1, "started": now_utc(),
                       "fake": self.fake, "stages": {}}
        self.lock = threading.Lock()

    # -- time and environments --

    def elapsed(self) -> float:
        return time.time() - self.started

    def left(self) -> float:
        return self.budget - self.elapsed()

    def base_env(self) -> dict:
        env = dict(os.environ)
        for key in list(env):
            if key in ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF", "VGPU_CONFIG_FILE") \
                    or key.startswith(("CUDA_DEVICE_MEMORY_", "CUDA_DEVICE_SM_LIMIT", "GPU_CORE_UTILIZATION")):
                del env[key]
        if not self.fake:
            for key in list(env):
                if key.startswith("FAKECUDA_"):
                    del env[key]
            own = os.path.join(self.build, "lib")
            parts = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p and os.path.abspath(p) != own]
            if parts:
                env["LD_LIBRARY_PATH"] = ":".join(parts)
            else:
                env.pop("LD_LIBRARY_PATH", None)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def shim_env(self, name: str, memory: str | None = None, sm: int | None = None, policy: str | None = "force",
                 **extra) -> dict:
        env = self.base_env()
        region = os.path.join(self.tmp, f"{name}.region")
        if os.path.exists(region):
            os.unlink(region)
        env["LD_PRELOAD"] = self.shim
        env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = region
        if memory:
            env["CUDA_DEVICE_MEMORY_LIMIT"] = memory
        if sm:
            env["CUDA_DEVICE_SM_LIMIT"] = str(sm)
        if policy and (memory or sm):
            env["GPU_CORE_UTILIZATION_POLICY"] = policy
        env.update({k: v for k, v in extra.items() if v is not None})
        return env

    def have_fakecuda(self) -> bool:
        return all(os.path.exists(os.path.join(self.build, "lib", f)) for f in ("libcuda.so.1", "libnvidia-ml.so.1"))

    def torch(self, *args) -> list[str]:
        return [sys.executable, WORKLOADS, *args]

    # -- the report --

    def save(self) -> None:
        with self.lock:
            self.report["updated"] = now_utc()
            self.report["wall_s"] = round(self.elapsed(), 1)
            path = os.path.join(self.out, "report.json")
            with open(path + ".tmp", "w") as handle:
                json.dump(self.report, handle, indent=1, sort_keys=False)
            os.replace(path + ".tmp", path)
            with open(os.path.join(self.out, "report.md.tmp"), "w") as handle:
                handle.write(render(self.report))
            os.replace(os.path.join(self.out, "report.md.tmp"), os.path.join(self.out, "report.md"))

    # -- stage 0: what machine, what tree --

    def environment(self) -> None:
        env = {"date": now_utc(), "host": platform.node(), "kernel": platform.release(),
               "python": sys.version.split()[0], "build": self.build,
               "build_info": os.environ.get("VGPU_GPU_BUILD_INFO", "").strip(),
               "commit": os.environ.get("VGPU_COMMIT") or None,
               "command": os.environ.get("VGPU_GPU_COMMAND") or "VGPU_COMMIT=<sha> bash tests/gpu/run.sh"}
        head = run(["git", "-C", REPO, "rev-parse", "HEAD"], timeout=20)
        env["device_checkout_head"] = head["stdout"].strip() if head["rc"] == 0 else None
        if not env["commit"]:
            env["commit"] = env["device_checkout_head"]
            env["commit_source"] = "git rev-parse HEAD of the tree the suite ran in"
        else:
            env["commit_source"] = "VGPU_COMMIT"
        status = run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"], timeout=20)
        env["device_checkout_modified_files"] = len(status["stdout"].splitlines()) if status["rc"] == 0 else None
        if self.smi:
            done = run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit,"
                        "pci.bus_id", "--format=csv,noheader"], timeout=30)
            parts = [p.strip() for p in done["stdout"].strip().splitlines()[0].split(",")] if done["rc"] == 0 else []
            keys = ["gpu", "driver", "memory_total", "sm_clock_max", "power_limit", "pci_bus_id"]
            env.update(dict(zip(keys, parts)))
            header = run(["nvidia-smi"], timeout=30)["stdout"]
            found = re.search(r"CUDA Version:\s*([0-9.]+)", header)
            env["cuda_version"] = found.group(1) if found else None
            env["gpu_count"] = len(run(["nvidia-smi", "-L"], timeout=30)["stdout"].strip().splitlines())
        if self.nvml.ok:
            n, h = self.nvml.n, self.nvml.handle
            name = self.nvml.call("nvmlDeviceGetName", h)
            env.setdefault("gpu", name.decode() if isinstance(name, bytes) else name)
            driver = self.nvml.call("nvmlSystemGetDriverVersion")
            env.setdefault("driver", driver.decode() if isinstance(driver, bytes) else driver)
            cuda = self.nvml.call("nvmlSystemGetCudaDriverVersion_v2") or self.nvml.call("nvmlSystemGetCudaDriverVersion")
            if cuda and not env.get("cuda_version"):
                env["cuda_version"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
        else:
            env["nvml_error"] = self.nvml.error
        env["vgpu_conf_present"] = os.path.exists("/etc/vgpu/vgpu.conf")
        compiler = run(["c++", "--version"], timeout=20)
        env["compiler"] = compiler["stdout"].splitlines()[0] if compiler["rc"] == 0 and compiler["stdout"] else None
        self.report["env"] = env
        log(f"GPU {env.get('gpu')}, driver {env.get('driver')}, CUDA {env.get('cuda_version')}, "
            f"commit {env.get('commit')} (device checkout HEAD {env.get('device_checkout_head')})")
        self.save()

    # -- stage 1: conformance, the real driver and fakecuda --

    def conformance(self) -> dict:
        binaries = sorted(glob.glob(os.path.join(self.build, "bin", "conformance_*_test")))
        if not binaries:
            return {"status": "skipped", "note": "no conformance binaries in the build (see build.log)"}
        real_env = self.base_env()
        if self.fake:
            real_env["FAKECUDA_STATE"] = os.path.join(self.tmp, "conformance-real")
            os.makedirs(real_env["FAKECUDA_STATE"], exist_ok=True)
        fake_env = self.base_env()
        for key in list(fake_env):
            if key.startswith("FAKECUDA_"):
                del fake_env[key]
        fake_env["LD_LIBRARY_PATH"] = os.path.join(self.build, "lib")
        fake_env["FAKECUDA_STATE"] = os.path.join(self.tmp, "conformance-fake")
        os.makedirs(fake_env["FAKECUDA_STATE"], exist_ok=True)
        tests = []  # (binary, suite, test name)
        for binary in binaries:
            suite = os.path.basename(binary)[len("conformance_"):-len("_test")]
            listed = run([binary, "--gtest_list_tests"], env=fake_env, timeout=30)
            group = None
            for line in listed["stdout"].splitlines():
                if not line.strip():
                    continue
                if not line.startswith(" "):
                    group = line.split("#")[0].strip()
                elif group:
                    tests.append((binary, suite, group + line.split("#")[0].strip()))
        result = {"status": "done", "binaries": len(binaries), "tests": len(tests)}
        for where, env, serial in (("real", real_env, True), ("fakecuda", fake_env, False)):
            if where == "fakecuda" and not self.have_fakecuda():
                result[where] = {"status": "skipped", "note": "fakecuda was not built (see build.log)"}
                continue
            if self.left() < 60:
                result[where] = {"status": "skipped", "note": f"{self.left():.0f} s left"}
                continue
            begin = time.time()
            outcomes = self.run_tests(tests, env, serial, where, deadline=begin + min(120.0 if serial else 45.0, self.left() - 30))
            counts = {k: sum(1 for o in outcomes.values() if o["status"] == k)
                      for k in ("passed", "failed", "skipped", "notrun")}
            result[where] = {"status": "done", "wall_s": round(time.time() - begin, 1), **counts,
                             "failures": [{"test": name, **{k: v for k, v in o.items() if k != "status"}}
                                          for name, o in sorted(outcomes.items()) if o["status"] == "failed"],
                             "skips": [{"test": name, "message": o.get("message", "")}
                                       for name, o in sorted(outcomes.items()) if o["status"] == "skipped"],
                             "outcomes": {name: o["status"] for name, o in sorted(outcomes.items())}}
            log(f"conformance on {where}: {counts} in {time.time() - begin:.1f} s")
            self.report["stages"]["conformance"] = result
            self.save()
        if result.get("real", {}).get("outcomes") and result.get("fakecuda", {}).get("outcomes"):
            real, fake = result["real"]["outcomes"], result["fakecuda"]["outcomes"]
            result["differences"] = [{"test": t, "real": real.get(t), "fakecuda": fake.get(t)}
                                     for t in sorted(set(real) | set(fake)) if real.get(t) != fake.get(t)]
        return result

    def run_tests(self, tests, env, serial_on_gpu: bool, where: str, deadline: float) -> dict:
        folder = os.path.join(self.tmp, f"gtest-{where}")
        os.makedirs(folder, exist_ok=True)

        def one(index_test):
            index, (binary, suite, name) = index_test
            if time.time() > deadline:
                return name, {"status": "notrun", "message": "the stage's time ran out"}
            output = os.path.join(folder, f"{index}.json")
            done = run([binary, f"--gtest_filter={name}", f"--gtest_output=json:{output}"], env=env, timeout=60)
            return name, parse_gtest(done, output, name)

        indexed = list(enumerate(tests))
        serial = [t for t in indexed if serial_on_gpu and t[1][1] in SERIAL_SUITES]
        parallel = [t for t in indexed if not (serial_on_gpu and t[1][1] in SERIAL_SUITES)]
        outcomes = {}
        with concurrent.futures.ThreadPoolExecutor(max_workers=6 if serial_on_gpu else 8) as pool:
            for name, outcome in pool.map(one, parallel):
                outcomes[name] = outcome
        for item in serial:
            name, outcome = one(item)
            outcomes[name] = outcome
        return outcomes

    # -- stage 2: memory under CUDA_DEVICE_MEMORY_LIMIT=4g --

    def memory(self) -> dict:
        limit, limit_mib = "4g", 4096
        result = {"status": "done", "limit": limit, "limit_mib": limit_mib, "host_view_source":
                  "nvidia-smi --query-compute-apps" if self.smi else "pynvml nvmlDeviceGetComputeRunningProcesses"}
        tenants = []
        for size, expect in (("3g", "ok"), ("4g", "oom")):
            done = run([self.tenant, "--alloc", size, "--kernels", "10"], env=self.shim_env(f"m{size}", memory=limit),
                       timeout=60)
            line = (json_lines(done["stdout"]) or [{}])[-1]
            tenants.append({"alloc": size, "expected": expect, "status": line.get("status"), "exit": done["rc"],
                            "error": line.get("error"), "call": line.get("call"),
                            "held": line.get("status") == expect})
        result["vgpu_tenant"] = tenants
        self.report["stages"]["memory"] = result
        self.save()
        runs = []
        for conf in ("", "expandable_segments:True"):
            apps = AppsSampler(self.nvml, self.smi)
            apps.start()
            proc = start(self.torch("mem", "--hold", "2"),
                         env=self.shim_env(f"t{len(runs)}", memory=limit, PYTORCH_CUDA_ALLOC_CONF=conf or None))
            done = finish(proc, timeout=150)
            apps.stop()
            lines = {line.get("event"): line for line in json_lines(done["stdout"])}
            mine = [r for r in apps.rows if r[1] == proc.pid]
            nvml_mine = [r[2] for r in apps.nvml_rows if r[1] == proc.pid]
            matched = "pid" if mine else "any process (the pid was not listed)"
            rows = mine or apps.rows
            holding, released = lines.get("holding", {}), lines.get("released", {})
            during_hold = [r[2] for r in rows if holding.get("t", 0) <= r[0] <= released.get("t", 0)]
            start_line = lines.get("start", {})
            entry = {"alloc_conf": conf or "(default)", "exit": done["rc"], "timed_out": done["timed_out"],
                     "torch": start_line.get("torch"),
                     "mem_get_info_at_start_mib": [start_line.get("mem_get_info_free_mib"),
                                                   start_line.get("mem_get_info_total_mib")],
                     "oom": holding.get("oom"), "oom_message": holding.get("oom_message"),
                     "allocated_before_oom_mib": holding.get("allocated_mib"),
                     "reserved_mib": holding.get("reserved_mib"),
                     "mem_get_info_at_cap_mib": [holding.get("mem_get_info_free_mib"),
                                                 holding.get("mem_get_info_total_mib")],
                     "nvidia_smi_under_shim": holding.get("nvidia_smi_under_shim"),
                     "pynvml_under_shim": holding.get("pynvml_under_shim"),
                     "recovered_1gib_after_oom": lines.get("end", {}).get("recovered_1gib_after_oom"),
                     "host_samples": len(rows), "host_samples_while_holding": len(during_hold),
                     "host_matched_by": matched, "host_max_mib": max((r[2] for r in rows), default=None),
                     "host_max_while_holding_mib": max(during_hold, default=None), "host_sampler_errors": apps.errors,
                     "host_pynvml_samples": len(nvml_mine), "host_pynvml_max_mib": max(nvml_mine, default=None)}
            entry["held"] = bool(entry["oom"]) and entry["host_max_mib"] is not None \
                and entry["host_max_mib"] <= limit_mib and entry["mem_get_info_at_start_mib"][1] == limit_mib
            if done["rc"] != 0 or not lines:
                entry["stderr"] = tail(done["stderr"], 1500)
            runs.append(entry)
            log(f"memory, PyTorch {entry['alloc_conf']}: OOM {entry['oom']} after {entry['allocated_before_oom_mib']} "
                f"MiB, host max {entry['host_max_mib']} MiB over {entry['host_samples']} samples")
            result["pytorch"] = runs
            self.save()
        return result

    # -- stage 3: compute caps --

    def compute(self) -> dict:
        caps = [int(c) for c in (os.environ.get("VGPU_GPU_CAPS") or "10,30,50,70,90").split(",")]
        point = self.point_s
        result = {"status": "done", "policy": "force", "point_s": point, "caps": caps, "torch": {}, "tenant": {},
                  "notes": []}
        self.report["stages"]["compute"] = result
        sampler = Sampler(self.nvml)
        sampler.start()
        try:
            for cap in [0] + caps:
                if self.left() < 3 * point + 60:
                    result["notes"].append(f"cap {cap}: skipped, {self.left():.0f} s left")
                    continue
                env = self.base_env() if cap == 0 else self.shim_env(f"c{cap}", sm=cap)
                done = run(self.torch("compute", "--which", "mm8192,mm2048,add", "--seconds", str(point)), env=env,
                           timeout=3 * point + 90)
                for line in json_lines(done["stdout"]):
                    if line.get("event") != "result":
                        continue
                    clocks = sampler.between(line["t_start"], line["t_end"])
                    result["torch"].setdefault(line["workload"], {})[str(cap)] = {
                        "ops_per_s": rnd(line["ops_per_s"]), "ops": line["ops"], "elapsed_s": rnd(line["elapsed_s"]),
                        "description": line["description"], **clocks}
                if done["rc"] != 0:
                    result["notes"].append(f"torch at cap {cap}: exit {done['rc']}"
                                           f"{' (timed out)' if done['timed_out'] else ''}: {tail(done['stderr'], 800)}")
                done = run([self.tenant, "--seconds", str(point), "--kernel-us", "1000"], env=env, timeout=point + 40)
                t1 = time.time()
                line = (json_lines(done["stdout"]) or [{}])[-1]
                # NVML over the launch loop only (elapsed_s ends at its last kernel), not the process's start.
                result["tenant"][str(cap)] = {"busy_fraction": line.get("busy_fraction"),
                                              "kernels_per_s": line.get("kernels_per_s"), "status": line.get("status"),
                                              **sampler.between(t1 - (line.get("elapsed_s") or 0), t1)}
                log(f"compute cap {cap or 'none'}: " + ", ".join(
                    f"{w} {v[str(cap)]['ops_per_s']:.1f}/s" for w, v in result["torch"].items() if str(cap) in v)
                    + f", tenant busy {line.get('busy_fraction')}")
                self.finish_compute(result)
                self.save()
            if self.left() > 50:
                # Very short kernels: 5 us spin kernels, 8 in flight, uncapped and at 30 %.
                result["tenant_5us"] = {}
                for cap in (0, 30):
                    env = self.base_env() if cap == 0 else self.shim_env(f"s{cap}", sm=cap)
                    done = run([self.tenant, "--seconds", str(point), "--kernel-us", "5", "--depth", "8"], env=env,
                               timeout=point + 40)
                    line = (json_lines(done["stdout"]) or [{}])[-1]
                    result["tenant_5us"][str(cap)] = {k: line.get(k) for k in ("busy_fraction", "kernels_per_s",
                                                                               "status")}
                base = result["tenant_5us"]["0"].get("kernels_per_s")
                if base and result["tenant_5us"]["30"].get("kernels_per_s"):
                    result["tenant_5us"]["30"]["fraction_of_uncapped"] = rnd(
                        result["tenant_5us"]["30"]["kernels_per_s"] / base, 4)
                log(f"5 us kernels: {result['tenant_5us']}")
                self.save()
            if self.left() > 40:
                result["pair_tenant"] = self.pair_tenant(sampler, (30, 70))
                self.save()
            if self.left() > 40:
                result["pair_tenant_30_60"] = self.pair_tenant(sampler, (30, 60))
                self.save()
            if self.left() > 60:
                result["pair_torch"] = self.pair_torch(sampler)
                self.finish_compute(result)
                self.save()
        finally:
            sampler.stop()
        return result

    def plot_caps(self, result: dict) -> None:
        """caps.png beside the report: achieved against the cap per workload (tests/gpu/plot_caps.py)."""
        path = os.path.join(self.out, "caps.png")
        if os.path.exists(path):  # an earlier run's, in the same folder: never shown beside this report
            os.remove(path)
        try:
            here = os.path.dirname(os.path.abspath(__file__))
            if here not in sys.path:
                sys.path.insert(0, here)
            import plot_caps  # noqa: PLC0415 - beside this file; matplotlib only when there is something to draw
            series = plot_caps.series_of(self.report, source="report.json")
            if series:
                plot_caps.plot(series, path, plot_caps.describe(self.report))
                result["plot"] = "caps.png"
                log(f"compute: {path}")
        except Exception as error:  # noqa: BLE001 - a missing matplotlib must not lose the figures
            result.setdefault("notes", []).append(f"caps.png not drawn: {type(error).__name__}: {error}")

    @staticmethod
    def finish_compute(result) -> None:
        for workload, points in result["torch"].items():
            base = points.get("0")
            for cap, entry in points.items():
                if base and base.get("ops_per_s"):
                    entry["fraction_of_uncapped"] = rnd(entry["ops_per_s"] / base["ops_per_s"], 4)
                    if base.get("sm_mhz_median") and entry.get("sm_mhz_median") and workload.startswith("mm"):
                        entry["fraction_x_clock_ratio"] = rnd(entry["fraction_of_uncapped"] * base["sm_mhz_median"]
                                                              / entry["sm_mhz_median"], 4)
        base = result["tenant"].get("0", {}).get("kernels_per_s")
        for entry in result["tenant"].values():
            if base and entry.get("kernels_per_s"):
                entry["fraction_of_uncapped"] = rnd(entry["kernels_per_s"] / base, 4)

    def pair_tenant(self, sampler, caps: tuple[int, int]) -> dict:
        seconds = 5
        t0 = time.time()
        procs = {cap: start([self.tenant, "--seconds", str(seconds), "--kernel-us", "1000"],
                            env=self.shim_env(f"p{cap}", sm=cap)) for cap in caps}
        pair = {}
        for cap, proc in procs.items():
            done = finish(proc, timeout=seconds + 40)
            line = (json_lines(done["stdout"]) or [{}])[-1]
            pair[str(cap)] = {"busy_fraction": line.get("busy_fraction"), "kernels_per_s": line.get("kernels_per_s"),
                              "status": line.get("status")}
        pair["clocks"] = sampler.between(t0, time.time())
        log(f"pair {caps[0]}/{caps[1]} vgpu-tenant 1 ms: {pair[str(caps[0])]['busy_fraction']} / "
            f"{pair[str(caps[1])]['busy_fraction']}")
        return pair

    def pair_torch(self, sampler) -> dict:
        seconds = 5
        go = os.path.join(self.tmp, "pair.go")
        procs, ready = {}, {}
        for cap in (30, 70):
            ready[cap] = os.path.join(self.tmp, f"pair{cap}.ready")
            procs[cap] = start(self.torch("compute", "--which", "mm8192", "--seconds", str(seconds), "--ready",
                                          ready[cap], "--go", go), env=self.shim_env(f"q{cap}", sm=cap))
        give_up = time.time() + 90
        while not all(os.path.exists(r) for r in ready.values()) and time.time() < give_up:
            if any(p.poll() is not None for p in procs.values()):
                break
            time.sleep(0.01)
        with open(go, "w") as handle:
            handle.write("go")
        pair = {}
        for cap, proc in procs.items():
            done = finish(proc, timeout=seconds + 60)
            line = next((l for l in json_lines(done["stdout"]) if l.get("event") == "result"), {})
            entry = {"ops_per_s": rnd(line.get("ops_per_s")), "exit": done["rc"]}
            if line:
                entry.update(sampler.between(line["t_start"], line["t_end"]))
            else:
                entry["stderr"] = tail(done["stderr"], 800)
            pair[str(cap)] = entry
        log(f"pair 30/70 PyTorch matmul 8192: {pair['30'].get('ops_per_s')} / {pair['70'].get('ops_per_s')} per s")
        return pair

    # -- stage 4: overhead --

    def overhead(self) -> dict:
        configs = {"none": lambda: self.base_env(), "shim": lambda: self.shim_env("o-shim", policy=None),
                   "shim_limits": lambda: self.shim_env("o-limits", memory="70g", sm=99, policy="force")}
        order = ["none", "shim", "shim_limits", "shim_limits", "shim", "none", "none", "shim", "shim_limits"]
        result = {"status": "done", "order": order, "configs": {
            "none": "no shim", "shim": "LD_PRELOAD=libvgpu.so, no limits",
            "shim_limits": "LD_PRELOAD=libvgpu.so, CUDA_DEVICE_MEMORY_LIMIT=70g, CUDA_DEVICE_SM_LIMIT=99, force"},
            "rounds": []}
        for index, name in enumerate(order):
            if self.left() < 25:
                result["note"] = f"stopped after {index} of {len(order)} rounds: {self.left():.0f} s left"
                break
            entry = {"config": name}
            done = run(self.torch("overhead", "--samples", "3000", "--launches", "10000"), env=configs[name](),
                       timeout=90)
            line = next((l for l in json_lines(done["stdout"]) if l.get("event") == "result"), None)
            if line:
                entry.update({k: line[k] for k in ("sync_op_median_us", "sync_op_p10_us", "sync_op_p90_us",
                                                   "launch_rate_per_s")})
            else:
                entry["torch_error"] = f"exit {done['rc']}: {tail(done['stderr'], 600)}"
            done = run([self.tenant, "--seconds", "1.5", "--kernel-us", "1", "--depth", "64"], env=configs[name](),
                       timeout=40)
            line = (json_lines(done["stdout"]) or [{}])[-1]
            entry["tenant_launch_rate_per_s"] = line.get("kernels_per_s")
            done = run([self.tenant, "--seconds", "1.5", "--kernel-us", "1", "--depth", "1"], env=configs[name](),
                       timeout=40)
            line = (json_lines(done["stdout"]) or [{}])[-1]
            rate = line.get("kernels_per_s")
            entry["tenant_sync_launch_us"] = rnd(1e6 / rate) if rate else None
            result["rounds"].append(entry)
            log(f"overhead {name}: {entry}")
            result["summary"] = overhead_summary(result["rounds"])
            self.report["stages"]["overhead"] = result
            self.save()
        result["inproc"] = self.overhead_inproc(configs)
        self.report["stages"]["overhead"] = result
        self.save()
        return result

    def overhead_inproc(self, configs: dict) -> dict:
        """The launch path's cost inside one process (tests/gpu/launch_ab.cc): batches through the hook and straight
        into the driver's cuLaunchKernel alternate, so the host's slow and fast minutes hit both alike, which separate
        processes cannot do on a VM (docs/results-gpu.md, "Eleventh run"). Under `none` both paths are the driver's:
        the A/A check."""
        if self.fake:
            return {"status": "skipped", "note": "over fakecuda: launch_ab is built against the real driver"}
        ab = os.path.join(self.tmp, "launch_ab")
        cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
        done = run(["g++", "-O2", "-std=c++20", f"-I{cuda}/include", os.path.join(REPO, "tests", "gpu", "launch_ab.cc"),
                    "-o", ab, f"-L{cuda}/lib64/stubs", "-lcuda"], env=self.base_env(), timeout=120)
        if done["rc"] != 0:
            return {"status": "skipped", "note": f"launch_ab did not build: {tail(done['stderr'], 600)}"}
        cpu = "3" if (os.cpu_count() or 1) > 3 else "0"
        rounds = []
        for index in range(3):
            for name in ("none", "shim", "shim_limits") if index % 2 == 0 else ("shim_limits", "shim", "none"):
                if self.left() < 15:
                    break
                done = run(["taskset", "-c", cpu, ab, os.path.join(REPO, "sim", "tenant", "spin.ptx")],
                           env=configs[name](), timeout=60)
                for line in json_lines(done["stdout"]):
                    if "added" in line:
                        rounds.append({"round": index, "config": name, "pattern": line["pattern"],
                                       "added_percent": rnd(line["added"] * 100, 2),
                                       "hooked_ns": line.get("hooked_ns"), "driver_ns": line.get("driver_ns")})
        summary = {}
        for entry in rounds:
            summary.setdefault(entry["config"], {}).setdefault(entry["pattern"], []).append(entry["added_percent"])
        summary = {config: {pattern: {"median_added_percent": rnd(median(v), 2), "min": min(v), "max": max(v),
                                      "rounds": len(v)} for pattern, v in patterns.items()}
                   for config, patterns in summary.items()}
        log(f"overhead inside one process: {summary}")
        return {"status": "done" if rounds else "failed", "rounds": rounds, "summary": summary}

    # -- stage 5: fidelity --

    def fidelity(self) -> dict:
        native = glob.glob(os.path.join(self.build, "python", "vgpu", "_native*.so"))
        fallback = os.path.join(self.build, "bin", "run_scenario")
        if not native and not os.access(fallback, os.X_OK):
            return {"status": "skipped", "note": "neither vgpu._native nor tests/gpu/run_scenario.cc was built"}
        result = {"status": "done", "runner": "python3 -m vgpu run" if native else "tests/gpu/run_scenario.cc",
                  "scenarios": {}}
        folder = os.path.join(self.tmp, "scenarios")
        os.makedirs(folder, exist_ok=True)
        for name in ("single-tenant-30", "thirty-sixty", "thirty-seventy"):
            original = os.path.join(REPO, "scenarios", f"{name}.yaml")
            text = open(original).read()
            # A copy that runs on the machine's GPU, live only: gpu: real and mode: [live] in place of its own.
            real_text = re.sub(r"(?m)^(gpu|mode):.*\n", "", text)
            real_text = re.sub(r"(?m)^(name:.*\n)", r"\1gpu: real\nmode: [live]\n", real_text, count=1)
            if "gpu: real" not in real_text:
                real_text = "gpu: real\nmode: [live]\n" + real_text
            real_file = os.path.join(folder, f"{name}.yaml")
            with open(real_file, "w") as handle:
                handle.write(real_text)
            entry = {}
            for label, path, mode in (("gpu_live", real_file, "live"), ("fakecuda_live", original, "live"),
                                      ("fakecuda_virtual", original, "virtual")):
                if self.left() < 25:
                    entry[label] = {"status": "skipped", "note": f"{self.left():.0f} s left"}
                    continue
                if label.startswith("fakecuda") and not self.have_fakecuda():
                    entry[label] = {"status": "skipped", "note": "fakecuda was not built"}
                    continue
                keep = label == "gpu_live"
                trace = os.path.join(self.out if keep else self.tmp, f"{name}-{label}.jsonl")
                entry[label] = self.scenario(path, mode, trace, bool(native), keep and name != "single-tenant-30")
                log(f"scenario {name} {label}: {entry[label].get('shares')} {entry[label].get('passed')}")
            shares = {label: e.get("shares") or {} for label, e in entry.items()}
            agreement = {}
            for tenant in shares.get("gpu_live", {}):
                real = shares["gpu_live"][tenant]
                agreement[tenant] = {other: rnd(real - shares[other][tenant], 2)
                                     for other in ("fakecuda_live", "fakecuda_virtual")
                                     if tenant in shares.get(other, {})}
            entry["gpu_minus_fakecuda_points"] = agreement
            entry["agree_within_3_points"] = bool(agreement) and all(
                abs(d) <= 3 for diffs in agreement.values() for d in diffs.values())
            result["scenarios"][name] = entry
            self.report["stages"]["fidelity"] = result
            self.save()
        return result

    def scenario(self, path, mode, trace, native: bool, plot: bool) -> dict:
        begin = time.time()
        if native:
            env = self.base_env()
            env["PYTHONPATH"] = os.path.join(REPO, "python") + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            env["VGPU_BUILD_DIR"] = self.build
            cmd = [sys.executable, "-m", "vgpu", "run", path, "--mode", mode, "--json", "--quiet", "--trace", trace]
            if plot:
                cmd += ["--plot", trace.replace(".jsonl", ".png")]
            done = run(cmd, env=env, timeout=90, cwd=REPO)
            if plot and done["rc"] not in (0, 1):  # matplotlib missing, say: once more without the plot
                done = run(cmd[:-2], env=env, timeout=90, cwd=REPO)
        else:
            done = run([os.path.join(self.build, "bin", "run_scenario"), path, mode, trace, self.build],
                       env=self.base_env(), timeout=90, cwd=REPO)
        entry = {"exit": done["rc"], "wall_s": rnd(time.time() - begin, 1)}
        summary = next((l for l in json_lines(done["stdout"]) if "tenants" in l), None)
        if summary:
            entry["passed"] = summary.get("passed")
            entry["vgpu_shares"] = {t["name"]: t.get("mean_share_percent") for t in summary["tenants"]}
            entry["failed_checks"] = [c.get("expected") + ": " + str(c.get("detail"))
                                      for c in summary.get("checks", []) if not c.get("passed")]
        if os.path.exists(trace):
            entry["shares"] = trace_shares(trace)
        if done["rc"] not in (0, 1) or "shares" not in entry:
            entry["error"] = tail(done["stderr"] or done["stdout"], 1200)
        return entry

    # -- stage 6: the node monitor (docs/node-monitor.md) beside capped tenants --

    def monitor(self) -> dict:
        """vgpu-monitor on this GPU: (1) what its verdict says of a capped tenant holding 2 GiB, against the host's
        own per-process view; (2) two processes capped at 30 % whose region's budget cell a third keeps full, with
        the verdict (each scales its own rate) and without (each held by its own count only)."""
        binary = os.path.join(self.build, "bin", "vgpu-monitor")
        if not os.path.exists(binary):
            return {"status": "skipped", "note": "vgpu-monitor was not built (see build.log)"}
        folder = os.path.join(self.tmp, "monitor")
        containers, verdicts = os.path.join(folder, "containers"), os.path.join(folder, "verdicts")
        os.makedirs(containers, exist_ok=True)
        cgroup = run([binary, "--cgroup-of", str(os.getpid())], timeout=10)["stdout"].strip()
        with open(os.path.join(containers, "box.conf"), "w") as conf:
            conf.write(f"VGPU_CGROUP={cgroup}\nCUDA_DEVICE_MEMORY_LIMIT=4g\nCUDA_DEVICE_SM_LIMIT=30\n")
        verdict_path = os.path.join(verdicts, "box", "verdict")
        log_path = os.path.join(self.out, "monitor.log")
        result = {"status": "done", "cgroup": cgroup, "period_ms": 100}
        with open(log_path, "w") as monitor_log:
            monitor = subprocess.Popen([binary, "--containers", containers, "--verdicts", verdicts, "--period-ms", "100",
                                        "--log-level", "2"], env=self.base_env(), stdout=monitor_log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
            try:
                result["figures"] = self.monitor_figures(verdict_path)
                self.report["stages"]["monitor"] = result
                self.save()
                result["compute_collusion"] = {
                    name: self.monitor_collusion(verdict_path if with_verdict else "", name)
                    for name, with_verdict in (("without_verdict", False), ("with_verdict", True))}
            finally:
                kill_group(monitor)
                monitor.wait(timeout=10)
        result["log_tail"] = tail(open(log_path).read(), 1500)
        return result

    @staticmethod
    def read_verdict(path: str) -> dict:
        try:
            text = open(path).read()
        except OSError:
            return {}
        out = {"devices": [], "processes": {}}
        for line in text.splitlines():
            words = line.split()
            if words and words[0] == "device":
                out["devices"].append({k: int(v) for k, v in (w.split("=") for w in words[2:])})
            elif words and words[0] == "process":
                out["processes"][int(words[1])] = {k: (v if k == "device" else int(v))
                                                   for k, v in (w.split("=") for w in words[2:])}
        return out

    def monitor_figures(self, verdict_path: str) -> dict:
        env = self.shim_env("monitor-hold", memory="4g", sm=30, VGPU_VERDICT_FILE=verdict_path)
        tenant = start([self.tenant, "--alloc", "2g", "--seconds", "5", "--kernel-us", "1000"], env=env)
        rows = []
        while tenant.poll() is None:
            time.sleep(0.25)
            verdict = self.read_verdict(verdict_path)
            mine = verdict.get("processes", {}).get(tenant.pid)
            host = [mib for pid, mib in self.nvml.processes() if pid == tenant.pid] if self.nvml.ok else []
            if mine:
                device = verdict["devices"][0]
                rows.append({"verdict_process_mib": round(mine["memory_used"] / 2**20, 1),
                             "host_mib": host[0] if host else None,
                             "verdict_container_mib": round(device["memory_used"] / 2**20, 1),
                             "sm_used_permille": device["sm_used"], "process_sm_permille": mine["sm_used"]})
        done = finish(tenant, 30)
        line = (json_lines(done["stdout"]) or [{}])[-1]
        # (A verdict is up to one period old: the first one after the allocation may predate it.)
        compared = [abs(r["verdict_process_mib"] - r["host_mib"]) for r in rows if r["host_mib"] is not None]
        return {"samples": len(rows), "tenant_busy_fraction": line.get("busy_fraction"),
                "compared": len(compared), "equal": sum(1 for d in compared if d == 0),
                "median_abs_difference_mib": median(compared) if compared else None,
                "max_abs_difference_mib": max(compared, default=None),
                "sm_used_permille": [r["sm_used_permille"] for r in rows], "rows": rows[:40]}

    def monitor_collusion(self, verdict_path: str, name: str) -> dict:
        env = self.shim_env(f"collude-{name}", sm=30, VGPU_VERDICT_FILE=verdict_path)
        tenants = [start([self.tenant, "--seconds", "10", "--kernel-us", "1000", "--report-ms", "1000"], env=env)
                   for _ in range(2)]
        writer_env = self.base_env()
        writer_env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]
        writer = start([sys.executable, CELL_WRITER, "300", "10"], env=writer_env)
        outputs = [finish(t, 60) for t in tenants]
        written = finish(writer, 30)
        per_second = []  # the two tenants' busy time per second, summed: share of the device
        reports = [[r for r in json_lines(o["stdout"]) if r.get("ev") == "report"] for o in outputs]
        for k in range(min(len(r) for r in reports)):
            busy = sum(r[k]["busy_ns"] - (r[k - 1]["busy_ns"] if k else 0) for r in reports)
            per_second.append(round(100 * busy / 1e9, 1))
        return {"writer": [json.loads(l) for l in written["stdout"].splitlines() if l.startswith("{")],
                "share_per_second_percent": per_second,
                "last_4s_percent": round(sum(per_second[-5:-1]) / 4, 1) if len(per_second) >= 5 else None}

    # -- driver --

    def main(self) -> int:
        stages = [s.strip() for s in (os.environ.get("VGPU_GPU_STAGES") or ",".join(STAGES)).split(",") if s.strip()]
        self.environment()
        if self.report["env"].get("vgpu_conf_present"):
            log("/etc/vgpu/vgpu.conf exists: the shim would ignore the environment; the suite cannot set limits")
            self.report["error"] = "/etc/vgpu/vgpu.conf exists here"
            self.save()
            return 1
        minimum = {"conformance": 60, "memory": 40, "compute": 90, "overhead": 40, "fidelity": 40, "monitor": 40}
        for stage in stages:
            if stage not in STAGES:
                log(f"unknown stage {stage!r}; known: {', '.join(STAGES)}")
                continue
            if self.left() < minimum[stage]:
                self.report["stages"][stage] = {"status": "skipped", "note": f"{self.left():.0f} s left of the budget"}
                log(f"{stage}: skipped, {self.left():.0f} s left")
                self.save()
                continue
            log(f"stage {stage} ({self.left():.0f} s left)")
            begin = time.time()
            try:
                result = getattr(self, stage)()
            except Exception:  # noqa: BLE001 - one stage's failure must not lose the others
                result = dict(self.report["stages"].get(stage) or {})
                result["status"] = "error"
                result["error"] = traceback.format_exc()[-3000:]
                log(f"stage {stage} broke:\n{result['error']}")
            result["wall_s"] = round(time.time() - begin, 1)
            self.report["stages"][stage] = result
            if stage == "compute":
                self.plot_caps(result)
            self.save()
        self.report["finished"] = now_utc()
        self.save()
        log(f"done in {self.elapsed():.0f} s; report: {os.path.join(self.out, 'report.md')}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        return 0


def parse_gtest(done: dict, output: str, name: str) -> dict:
    text = (done["stdout"] or "") + (done["stderr"] or "")
    data = None
    if os.path.exists(output):
        try:
            with open(output) as handle:
                data = json.load(handle)
        except (OSError, json.JSONDecodeError):
            data = None
    if data:
        for suite in data.get("testsuites", []):
            for test in suite.get("testsuite", []):
                if f"{suite.get('name')}.{test.get('name')}" != name:
                    continue
                if test.get("failures"):
                    return {"status": "failed",
                            "message": "\n".join(f.get("failure", "") for f in test["failures"])[:2000]}
                if test.get("result") == "SKIPPED" or "[  SKIPPED ]" in text:
                    found = re.search(r"Skipped\n(.*?)\n\[  SKIPPED \]", text, re.S)
                    return {"status": "skipped", "message": (found.group(1).strip() if found else "")[:500]}
                if done["rc"] == 0:
                    return {"status": "passed"}
    if done["timed_out"]:
        return {"status": "failed", "message": f"timed out after {done['wall_s']:.0f} s: {tail(text, 800)}"}
    if done["rc"] == 0 and "[  PASSED  ] 1 test" in text:
        return {"status": "passed"}
    return {"status": "failed", "message": f"exit {done['rc']} without a result (crash?): {tail(text, 1200)}"}


def overhead_summary(rounds: list[dict]) -> dict:
    keys = ("sync_op_median_us", "launch_rate_per_s", "tenant_launch_rate_per_s", "tenant_sync_launch_us")
    per = {}
    for entry in rounds:
        per.setdefault(entry["config"], []).append(entry)
    # The median of each configuration's rounds: one disturbed round (this host's noise is ~10 %) moves it least.
    summary = {"per_config": {}, "vs_none_percent": {}, "statistic": "median of the rounds"}
    for config, entries in per.items():
        summary["per_config"][config] = {k: rnd(median(e.get(k) for e in entries), 2) for k in keys}
        summary["per_config"][config]["rounds"] = len(entries)
    base = summary["per_config"].get("none")
    if base:
        for config, values in summary["per_config"].items():
            if config == "none":
                continue
            change = {}
            for key in keys:
                if values.get(key) and base.get(key):
                    ratio = values[key] / base[key]
                    # Latencies: + is slower; rates: the loss, + is slower too.
                    change[key] = rnd((ratio - 1) * 100 if key.endswith("_us") else (1 - ratio) * 100, 2)
            summary["vs_none_percent"][config] = change
        # The noise floor: how far the two no-shim rounds are apart.
        nones = per.get("none", [])
        if len(nones) >= 2:
            spread = {}
            for key in keys:
                values = [e[key] for e in nones if e.get(key)]
                if len(values) >= 2:
                    spread[key] = rnd((max(values) - min(values)) / min(values) * 100, 2)
            summary["none_round_spread_percent"] = spread
    return summary


def trace_shares(path: str) -> dict:
    """Mean share (percent) per tenant over the judged windows [settle, duration), from the trace's samples."""
    head, busy = None, {}
    with open(path) as handle:
        for line in handle:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("ev") == "run":
                head = event
            elif event.get("ev") == "sample":
                busy.setdefault(event["tenant"], {}).setdefault(event["t_ns"], 0)
                busy[event["tenant"]][event["t_ns"]] += event["busy_ns"]
    if not head:
        return {}
    window, settle, duration = head["window_ns"], head["settle_ns"], head["duration_ns"]
    shares = {}
    for tenant, series in busy.items():
        values = []
        t = settle
        while t + window <= duration:
            if t in series and t + window in series:
                values.append((series[t + window] - series[t]) / window * 100)
            t += window
        if values:
            shares[tenant] = round(statistics.fmean(values), 2)
    return shares


# ---- the markdown report -------------------------------------------------------------------------------------------


def fmt(value, digits=1, suffix=""):
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def pct(value, digits=1):
    return "—" if value is None else f"{value * 100:.{digits}f} %"


def render(report: dict) -> str:
    env = report.get("env", {})
    stages = report.get("stages", {})
    lines = ["# vgpu GPU suite report", ""]
    if report.get("fake"):
        lines += ["**Plumbing test over fakecuda (VGPU_GPU_FAKE=1): the figures mean nothing.**", ""]
    lines += [f"- date: {env.get('date', report.get('started'))} (report updated {report.get('updated')}, "
              f"{report.get('wall_s')} s after the command started)",
              f"- GPU: {env.get('gpu')} ({env.get('memory_total')}, SM clock max {env.get('sm_clock_max')}, "
              f"power limit {env.get('power_limit')}, {env.get('gpu_count')} GPU(s))",
              f"- driver: {env.get('driver')}, CUDA {env.get('cuda_version')}",
              f"- commit: {env.get('commit')} ({env.get('commit_source')}); the device checkout's HEAD: "
              f"{env.get('device_checkout_head')}",
              f"- command: `{env.get('command')}`",
              f"- host: {env.get('host')}, kernel {env.get('kernel')}, Python {env.get('python')}",
              f"- build: Release, {env.get('compiler')}; {env.get('build_info') or 'everything built'}", ""]
    conf = stages.get("conformance")
    if conf:
        lines += ["## 1. Conformance: the same tests on the real driver and on fakecuda", ""]
        if conf.get("status") != "done":
            lines += [f"{conf.get('status')}: {conf.get('note') or conf.get('error', '')}", ""]
        lines += [f"{conf.get('tests')} tests in {conf.get('binaries')} binaries, each test in its own process "
                  "(gtest_filter), as ctest runs them; on the GPU the suites that compare free memory or list "
                  "processes one at a time.", "",
                  "| driver | passed | failed | skipped | not run | wall |", "|---|---|---|---|---|---|"]
        for where in ("real", "fakecuda"):
            r = conf.get(where)
            if r:
                lines.append(f"| {where} | {r.get('passed', '—')} | {r.get('failed', '—')} | {r.get('skipped', '—')} | "
                             f"{r.get('notrun', '—')} | "
                             f"{fmt(r.get('wall_s'), 1, ' s')} |")
        lines.append("")
        for where in ("real", "fakecuda"):
            for failure in (conf.get(where) or {}).get("failures", []):
                message = failure.get("message", "").strip().replace("\n", " / ")[:500]
                lines.append(f"- FAILED on {where}: `{failure['test']}`: {message}")
            for skip in (conf.get(where) or {}).get("skips", []):
                lines.append(f"- skipped on {where}: `{skip['test']}`: {skip.get('message', '')[:200]}")
        if conf.get("differences") is not None:
            lines.append(f"- outcomes that differ between the two: {len(conf['differences'])}" + (
                "" if not conf["differences"] else ": " + ", ".join(
                    f"`{d['test']}` ({d['real']} / {d['fakecuda']})" for d in conf["differences"])))
        lines.append("")
    mem = stages.get("memory")
    if mem:
        lines += [f"## 2. Memory: CUDA_DEVICE_MEMORY_LIMIT={mem.get('limit')}", ""]
        if mem.get("status") != "done":
            lines += [f"{mem.get('status')}: {mem.get('note') or mem.get('error', '')}", ""]
        for t in mem.get("vgpu_tenant", []):
            lines.append(f"- vgpu-tenant --alloc {t['alloc']}: status {t['status']} (expected {t['expected']}), "
                         f"exit {t['exit']}{', ' + str(t['error']) + ' from ' + str(t['call']) if t.get('error') else ''}"
                         f": {'held' if t['held'] else 'NOT as expected'}")
        if mem.get("pytorch"):
            lines += ["", f"Host view: {mem.get('host_view_source')}, sampled outside the shim while each process ran.",
                      "", "| PyTorch allocator | mem_get_info at start (free / total MiB) | allocated before OOM | "
                      "nvidia-smi under the shim (total / used MiB) | host view max (MiB) | samples (while holding) | pynvml host max (MiB) | "
                      "1 GiB again after OOM | held |", "|---|---|---|---|---|---|---|---|---|"]
            for r in mem["pytorch"]:
                smi = r.get("nvidia_smi_under_shim") or {}
                smi_text = f"{smi.get('total_mib')} / {smi.get('used_mib')}" if "total_mib" in smi else \
                    str(smi.get("error", "—"))[:80]
                start_view = r.get("mem_get_info_at_start_mib") or [None, None]
                lines.append(f"| {r['alloc_conf']} | {start_view[0]} / {start_view[1]} | "
                             f"{fmt(r.get('allocated_before_oom_mib'), 0, ' MiB')} | {smi_text} | "
                             f"{r.get('host_max_mib')} | {r.get('host_samples')} ({r.get('host_samples_while_holding')}) "
                             f"| {r.get('host_pynvml_max_mib')} | {r.get('recovered_1gib_after_oom')} | {'yes' if r.get('held') else 'NO'} |")
            for r in mem["pytorch"]:
                lines.append(f"- {r['alloc_conf']}: OutOfMemoryError: {str(r.get('oom_message'))[:300]}")
                if r.get("stderr"):
                    lines.append(f"  - stderr: {r['stderr'][-300:]}")
        lines.append("")
    comp = stages.get("compute")
    if comp:
        lines += [f"## 3. Compute caps ({comp.get('policy')}), {comp.get('point_s')} s per point", ""]
        if comp.get("status") != "done":
            lines += [f"{comp.get('status')}: {comp.get('error', '')}", ""]
        if comp.get("plot"):
            lines += [f"![achieved against the cap, per workload]({comp['plot']})", ""]
        caps = ["0"] + [str(c) for c in comp.get("caps", [])]
        for workload, points in comp.get("torch", {}).items():
            description = next(iter(points.values())).get("description", workload)
            lines += [f"**PyTorch {description}**", "",
                      "| cap | ops/s | of uncapped | × clock ratio | SM clock MHz (median, min–max) | NVML util % (from 1 s in) | power W |",
                      "|---|---|---|---|---|---|---|"]
            for cap in caps:
                e = points.get(cap)
                if not e:
                    continue
                lines.append(f"| {'none' if cap == '0' else cap + ' %'} | {fmt(e.get('ops_per_s'))} | "
                             f"{pct(e.get('fraction_of_uncapped'))} | {pct(e.get('fraction_x_clock_ratio'))} | "
                             f"{fmt(e.get('sm_mhz_median'), 0)} ({fmt(e.get('sm_mhz_min'), 0)}–{fmt(e.get('sm_mhz_max'), 0)}) | "
                             f"{fmt(e.get('util_mean'))} | {fmt(e.get('power_w_mean'), 0)} |")
            lines.append("")
        if comp.get("tenant"):
            lines += ["**vgpu-tenant 1 ms spin kernels** (busy fraction: the GPU time its kernels ran / wall time, exact)",
                      "", "| cap | busy (own time share) | kernels/s | of uncapped | SM clock MHz | NVML util % (from 1 s in) |",
                      "|---|---|---|---|---|---|"]
            for cap in caps:
                e = comp["tenant"].get(cap)
                if e:
                    lines.append(f"| {'none' if cap == '0' else cap + ' %'} | {pct(e.get('busy_fraction'))} | "
                                 f"{fmt(e.get('kernels_per_s'))} | {pct(e.get('fraction_of_uncapped'))} | "
                                 f"{fmt(e.get('sm_mhz_median'), 0)} | {fmt(e.get('util_mean'))} |")
            lines.append("")
        if comp.get("tenant_5us"):
            t5 = comp["tenant_5us"]
            lines += [f"**vgpu-tenant 5 µs spin kernels, depth 8**: uncapped busy {pct(t5.get('0', {}).get('busy_fraction'))} "
                      f"at {fmt(t5.get('0', {}).get('kernels_per_s'), 0)} kernels/s; at 30 % busy "
                      f"{pct(t5.get('30', {}).get('busy_fraction'))} at {fmt(t5.get('30', {}).get('kernels_per_s'), 0)} "
                      f"kernels/s = {pct(t5.get('30', {}).get('fraction_of_uncapped'))} of uncapped throughput", ""]
        if comp.get("pair_tenant") or comp.get("pair_torch"):
            lines += ["**Two containers side by side, capped 30 % and 70 %**", ""]
            for key, (a, b) in (("pair_tenant", ("30", "70")), ("pair_tenant_30_60", ("30", "60"))):
                p = comp.get(key)
                if p and a in p and b in p:
                    lines.append(f"- vgpu-tenant 1 ms, 5 s, capped {a} / {b}: busy {pct(p[a].get('busy_fraction'))} / "
                                 f"{pct(p[b].get('busy_fraction'))} (sum "
                                 f"{pct((p[a].get('busy_fraction') or 0) + (p[b].get('busy_fraction') or 0))}), "
                                 f"SM clock {fmt(p.get('clocks', {}).get('sm_mhz_median'), 0)} MHz")
            p = comp.get("pair_torch")
            if p:
                base = (comp.get("torch", {}).get("mm8192", {}).get("0") or {}).get("ops_per_s")
                parts = []
                for cap in ("30", "70"):
                    e = p.get(cap, {})
                    frac = e["ops_per_s"] / base if base and e.get("ops_per_s") else None
                    parts.append(f"{cap} %: {fmt(e.get('ops_per_s'))}/s ({pct(frac)} of uncapped alone), SM clock "
                                 f"{fmt(e.get('sm_mhz_median'), 0)} MHz")
                lines.append("- PyTorch bf16 matmul 8192, 5 s from a common start: " + "; ".join(parts))
            lines.append("")
        for note in comp.get("notes", []):
            lines.append(f"- note: {note[:600]}")
        lines.append("")
    over = stages.get("overhead")
    if over and over.get("summary"):
        s = over["summary"]
        lines += ["## 4. Overhead of the shim", "",
                  "Rounds in the order " + ", ".join(over.get("order", [])) + "; each value the "
                  + s.get("statistic", "mean of the rounds") + ".", "",
                  "| config | PyTorch sync tiny op, median µs | PyTorch tiny-op launches/s | vgpu-tenant 1 µs kernels, depth 64, launches/s | vgpu-tenant launch+sync µs |",
                  "|---|---|---|---|---|"]
        for config, v in s.get("per_config", {}).items():
            lines.append(f"| {config}: {over['configs'].get(config)} | {fmt(v.get('sync_op_median_us'), 2)} | "
                         f"{fmt(v.get('launch_rate_per_s'), 0)} | {fmt(v.get('tenant_launch_rate_per_s'), 0)} | "
                         f"{fmt(v.get('tenant_sync_launch_us'), 2)} |")
        lines += ["", "Added cost against no shim, percent (+ = slower; for rates, the throughput lost):", "",
                  "| config | sync tiny op | tiny-op launch rate | tenant launch rate | tenant launch+sync |", "|---|---|---|---|---|"]
        for config, v in s.get("vs_none_percent", {}).items():
            lines.append(f"| {config} | {fmt(v.get('sync_op_median_us'), 2, ' %')} | {fmt(v.get('launch_rate_per_s'), 2, ' %')} | "
                         f"{fmt(v.get('tenant_launch_rate_per_s'), 2, ' %')} | {fmt(v.get('tenant_sync_launch_us'), 2, ' %')} |")
        if s.get("none_round_spread_percent"):
            lines.append("")
            lines.append("Noise floor (the no-shim rounds' spread, (max − min) / min, percent): " + ", ".join(
                f"{k} {v}" for k, v in s["none_round_spread_percent"].items()))
        inproc = over.get("inproc") or {}
        if inproc.get("summary"):
            lines += ["", "Inside one process (tests/gpu/launch_ab.cc: batches through the hook and straight into the "
                      "driver alternate; `none`: both the driver's, the A/A check), added host time per launch, median "
                      "over rounds (min .. max):", "", "| config | pattern | added | rounds |", "|---|---|---|---|"]
            for config, patterns in inproc["summary"].items():
                for pattern, v in patterns.items():
                    lines.append(f"| {config} | {pattern} | {fmt(v['median_added_percent'], 2, ' %')} "
                                 f"({fmt(v['min'], 2)} .. {fmt(v['max'], 2)}) | {v['rounds']} |")
        elif inproc:
            lines += ["", f"Inside one process: {inproc.get('status')}: {inproc.get('note', '')}"]
        lines.append("")
    fid = stages.get("fidelity")
    if fid:
        lines += ["## 5. Fidelity: scenarios on the GPU and on fakecuda (h100-80gb)", ""]
        if fid.get("status") != "done":
            lines += [f"{fid.get('status')}: {fid.get('note') or fid.get('error', '')}", ""]
        else:
            lines += [f"Runner: {fid.get('runner')}. Mean share per tenant over the judged windows, from each trace.", "",
                      "| scenario | tenant | GPU live | fakecuda live | fakecuda virtual | GPU − fakecuda live / virtual | within 3 points |",
                      "|---|---|---|---|---|---|---|"]
            for name, e in fid.get("scenarios", {}).items():
                for tenant, diffs in (e.get("gpu_minus_fakecuda_points") or {}).items():
                    values = [((e.get(k) or {}).get("shares") or {}).get(tenant) for k in
                              ("gpu_live", "fakecuda_live", "fakecuda_virtual")]
                    lines.append(f"| {name} | {tenant} | {fmt(values[0], 2)} | {fmt(values[1], 2)} | {fmt(values[2], 2)} | "
                                 f"{fmt(diffs.get('fakecuda_live'), 2)} / {fmt(diffs.get('fakecuda_virtual'), 2)} | "
                                 f"{'yes' if all(abs(d) <= 3 for d in diffs.values()) else 'NO'} |")
            lines.append("")
            for name, e in fid.get("scenarios", {}).items():
                for label in ("gpu_live", "fakecuda_live", "fakecuda_virtual"):
                    r = e.get(label) or {}
                    verdict = {True: "PASS", False: "FAIL", None: "—"}[r.get("passed")]
                    extra = ("; failed: " + "; ".join(r["failed_checks"])) if r.get("failed_checks") else ""
                    error = f"; error: {r['error'][:300]}" if r.get("error") else ""
                    lines.append(f"- {name} {label}: expectations {verdict} (exit {r.get('exit')}, "
                                 f"{r.get('wall_s')} s){extra}{error}")
        lines.append("")
    mon = stages.get("monitor")
    if mon:
        lines += ["## 6. The node monitor (docs/node-monitor.md)", ""]
        if mon.get("status") != "done":
            lines += [f"{mon.get('status')}: {mon.get('note') or mon.get('error', '')}", ""]
        else:
            f = mon.get("figures") or {}
            lines += [f"A tenant capped at 4 GiB / 30 % holding 2 GiB: {f.get('samples')} samples of its verdict, "
                      f"{f.get('compared')} beside the host's view of the process: {f.get('equal')} equal to the MiB, "
                      f"median difference {fmt(f.get('median_abs_difference_mib'), 1, ' MiB')}, largest "
                      f"{fmt(f.get('max_abs_difference_mib'), 1, ' MiB')} (a verdict is up to one period old); the "
                      f"container's sm_used (permille) {f.get('sm_used_permille')}.", "",
                      "Two tenants capped at 30 % whose region's budget cell a third process keeps full "
                      "(tests/python/clients/cell_writer.py), share of the device per second (both together):", "",
                      "| | per second, % | last 4 s |", "|---|---|---|"]
            for name, c in (mon.get("compute_collusion") or {}).items():
                lines.append(f"| {name} | {c.get('share_per_second_percent')} | {fmt(c.get('last_4s_percent'), 1)} |")
            lines += ["", "```", mon.get("log_tail", ""), "```", ""]
    lines += ["## Stages", "", "| stage | status | wall |", "|---|---|---|"]
    for name, stage in stages.items():
        lines.append(f"| {name} | {stage.get('status')} | {fmt(stage.get('wall_s'), 1, ' s')} |")
    for name, stage in stages.items():
        if stage.get("error"):
            lines += ["", f"{name} error:", "", "```", stage["error"][-1500:], "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--build", required=True, help="the build folder (lib/libvgpu.so, bin/vgpu-tenant, ...)")
    parser.add_argument("--out", required=True, help="where report.json and report.md go")
    parser.add_argument("--render", metavar="REPORT_JSON", help="only render this report.json as markdown on stdout")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    return Suite(args).main()


if __name__ == "__main__":
    if "--render" in sys.argv:
        with open(sys.argv[sys.argv.index("--render") + 1]) as source:
            print(render(json.load(source)), end="")
        sys.exit(0)
    sys.exit(main())
