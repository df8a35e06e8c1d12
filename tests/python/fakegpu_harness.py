"""Runs client processes (python clients, vgpu-tenant) on a fakecuda machine of their own, and reads its trace.

Why subprocesses: pynvml and cuda.bindings dlopen libnvidia-ml.so.1 / libcuda.so.1 once per
process, and fakecuda reads its environment (FAKECUDA_STATE, FAKECUDA_DEVICES, ...) at first use,
so a fake machine chosen per test can only be given to a fresh process.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

CLIENTS_DIR = Path(__file__).resolve().parent / "clients"

# Inherited settings that would change which driver runs or what it models; each test sets its own.
_SCRUBBED_PREFIXES = ("FAKECUDA_", "CUDA_DEVICE_", "LIBCUDA_")
_SCRUBBED_NAMES = ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                   "GPU_CORE_UTILIZATION_POLICY", "CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM")


def parse_last_json_line(text: str, what: str) -> dict:
    """The last stdout line that is a JSON object: clients print their result there."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"{what} printed no JSON line on stdout; stdout was:\n{text}")


@dataclass
class ClientResult:
    """A finished client process: exit code, output and the JSON line it printed."""

    what: str
    returncode: int
    stdout: str
    stderr: str
    pid: int = 0

    @property
    def json(self) -> dict:
        return parse_last_json_line(self.stdout, self.what)

    def describe(self) -> str:
        return (f"{self.what} (pid {self.pid}) exited with {self.returncode}\n"
                f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}")


class BackgroundProcess:
    """A client left running while the test does other things; stdout lines are read by a thread.

    stderr goes to a file so that a chatty fake driver can never fill a pipe and stall the client.
    """

    def __init__(self, what: str, argv: list[str], env: dict[str, str], stderr_path: Path):
        self.what = what
        self.stderr_path = stderr_path
        self._stderr_file = open(stderr_path, "w")
        self.popen = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr_file, text=True)
        self.pid = self.popen.pid
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._all_lines: list[str] = []
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()

    def _read_stdout(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def stderr_text(self) -> str:
        if not self._stderr_file.closed:
            self._stderr_file.flush()
        return self.stderr_path.read_text(errors="replace")

    def next_json(self, timeout: float) -> dict:
        """Waits for the next JSON line the client prints (a 'ready' line, a result)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{self.what} (pid {self.pid}) printed no JSON line within {timeout} s; "
                                     f"stdout so far: {''.join(self._all_lines)!r}; stderr: {self.stderr_text()}")
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                self.popen.wait(timeout=5)
                raise AssertionError(f"{self.what} (pid {self.pid}) exited with {self.popen.returncode} before "
                                     f"printing the expected JSON line; stdout: {''.join(self._all_lines)!r}; "
                                     f"stderr: {self.stderr_text()}")
            self._all_lines.append(line)
            if line.strip().startswith("{"):
                return json.loads(line)

    def close_stdin(self) -> None:
        """Clients that hold resources wait for end of input, then release them and exit."""
        if self.popen.stdin is not None and not self.popen.stdin.closed:
            self.popen.stdin.close()

    def finish(self, timeout: float) -> ClientResult:
        """Waits for the exit; the result's stdout holds every line not yet taken by next_json too."""
        self.close_stdin()
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.what} (pid {self.pid}) did not exit within {timeout} s; "
                                 f"stderr: {self.stderr_text()}") from None
        self._release_pipes()
        while True:
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self._all_lines.append(line)
        return ClientResult(self.what, self.popen.returncode, "".join(self._all_lines),
                            self.stderr_path.read_text(errors="replace"), self.pid)

    def _release_pipes(self) -> None:
        """After the exit: the reader thread sees end of file, then every pipe and file is closed."""
        self.close_stdin()
        self._reader.join(timeout=5)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        self._stderr_file.close()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=10)
        self._release_pipes()


@dataclass
class FakeGpu:
    """One fake machine (a fresh FAKECUDA_STATE file) and the environment its client processes get.

    `env` may be changed (FAKECUDA_DEVICES, FAKECUDA_TRACE, ...) before the first process starts;
    every process of a test must see the same device configuration.
    """

    build_dir: Path
    work_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    _background: list[BackgroundProcess] = field(default_factory=list)
    _count: int = 0

    def __post_init__(self) -> None:
        base = {name: value for name, value in os.environ.items()
                if not name.startswith(_SCRUBBED_PREFIXES) and name not in _SCRUBBED_NAMES}
        library_dir = str(self.build_dir / "lib")
        inherited_library_path = base.get("LD_LIBRARY_PATH", "")
        base["LD_LIBRARY_PATH"] = library_dir + (os.pathsep + inherited_library_path if inherited_library_path else "")
        inherited_python_path = base.get("PYTHONPATH", "")
        base["PYTHONPATH"] = str(CLIENTS_DIR) + (os.pathsep + inherited_python_path if inherited_python_path else "")
        base["PYTHONUNBUFFERED"] = "1"
        base["PYTHONDONTWRITEBYTECODE"] = "1"
        base["FAKECUDA_STATE"] = str(self.work_dir / "state")
        base.update(self.env)
        self.env = base

    @property
    def library_dir(self) -> Path:
        return self.build_dir / "lib"

    @property
    def tenant_path(self) -> Path:
        return self.build_dir / "bin" / "vgpu-tenant"

    def use_shim(self, shim_path: Path, **settings: str) -> None:
        """Every process started from now on loads the shim, its region in this machine's folder, with `settings`
        (CUDA_DEVICE_MEMORY_LIMIT="4g", CUDA_DEVICE_SM_LIMIT="30", ...) in its environment."""
        self.env["LD_PRELOAD"] = str(shim_path)
        self.env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(self.work_dir / "region")
        self.env.update(settings)

    def enable_trace(self) -> Path:
        """Turns on FAKECUDA_TRACE (JSON lines) for every process started from now on."""
        trace_path = self.work_dir / "trace.jsonl"
        self.env["FAKECUDA_TRACE"] = str(trace_path)
        return trace_path

    def _python_argv(self, code_or_script: str | Path, args: tuple[str, ...]) -> tuple[list[str], str]:
        if isinstance(code_or_script, Path) or (code_or_script.endswith(".py") and "\n" not in code_or_script):
            script = Path(code_or_script)
            if not script.is_absolute():
                script = CLIENTS_DIR / script
            return [sys.executable, str(script), *map(str, args)], script.name
        return [sys.executable, "-c", textwrap.dedent(code_or_script), *map(str, args)], "python -c client"

    def run_py(self, code_or_script: str | Path, *args: str, timeout: float = 60, check: bool = True) -> ClientResult:
        """Runs a python client to completion: inline code, or a script under tests/python/clients/."""
        argv, what = self._python_argv(code_or_script, args)
        return self._run(argv, what, timeout, check)

    def start_py(self, code_or_script: str | Path, *args: str) -> BackgroundProcess:
        argv, what = self._python_argv(code_or_script, args)
        return self._start(argv, what)

    def tenant(self, *args: str, timeout: float = 60, check: bool = True) -> ClientResult:
        """Runs vgpu-tenant to completion; `.json` is its one result line."""
        return self._run([str(self.tenant_path), *map(str, args)], "vgpu-tenant", timeout, check)

    def start_tenant(self, *args: str) -> BackgroundProcess:
        return self._start([str(self.tenant_path), *map(str, args)], "vgpu-tenant")

    def run(self, program: str | Path, *args: str, timeout: float = 60, check: bool = True) -> ClientResult:
        """Runs any program to completion in this machine's environment (the shim tests' worker, say)."""
        return self._run([str(program), *map(str, args)], Path(program).name, timeout, check)

    def _run(self, argv: list[str], what: str, timeout: float, check: bool) -> ClientResult:
        process = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
            raise AssertionError(f"{what} did not finish within {timeout} s\n--- stdout ---\n{stdout}\n"
                                 f"--- stderr ---\n{stderr}") from None
        result = ClientResult(what, process.returncode, stdout, stderr, process.pid)
        if check and result.returncode != 0:
            raise AssertionError(result.describe())
        return result

    def _start(self, argv: list[str], what: str) -> BackgroundProcess:
        self._count += 1
        stderr_path = self.work_dir / f"stderr-{self._count}-{Path(argv[0]).name}.txt"
        process = BackgroundProcess(what, argv, self.env, stderr_path)
        self._background.append(process)
        return process

    def stop_all(self) -> None:
        """Test teardown: kills, by pid, whatever this fake machine's test left running."""
        for process in self._background:
            process.kill()


def rate_ratio(free: dict, capped: dict) -> tuple[float, float]:
    """Two runs' {"kernels", "seconds"}: the free run's rate, and the capped run's rate as a fraction of it."""
    free_rate = free["kernels"] / free["seconds"]
    return free_rate, capped["kernels"] / capped["seconds"] / free_rate


def read_trace(trace_path: Path) -> list[dict]:
    """The FAKECUDA_TRACE file: one JSON object per line."""
    events = []
    with open(trace_path) as trace:
        for number, line in enumerate(trace, start=1):
            line = line.strip()
            if not line:
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise AssertionError(f"{trace_path}:{number} is not a JSON object ({error}): {line!r}") from None
    return events


def _union_length(intervals: list[tuple[int, int]]) -> int:
    total = 0
    current_start = current_end = None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


@dataclass
class KernelShares:
    """Device time per process over the interval in which all of them were running kernels."""

    window_start_ns: int
    window_end_ns: int
    busy_ns_by_pid: dict[int, int]
    device_busy_ns: int

    @property
    def window_ns(self) -> int:
        return self.window_end_ns - self.window_start_ns

    def share(self, pid: int) -> float:
        return self.busy_ns_by_pid[pid] / self.window_ns

    @property
    def device_busy_fraction(self) -> float:
        return self.device_busy_ns / self.window_ns


def kernel_shares(events: list[dict], pids: list[int], device: int = 0) -> KernelShares:
    """Per-pid busy time from trace kernel events, clipped to the interval all pids overlap."""
    kernels_by_pid: dict[int, list[tuple[int, int]]] = {pid: [] for pid in pids}
    ran_by_pid: dict[int, list[tuple[int, int, int]]] = {pid: [] for pid in pids}
    for event in events:
        if event.get("ev") == "kernel" and event.get("pid") in kernels_by_pid and event.get("device", 0) == device:
            kernels_by_pid[event["pid"]].append((int(event["start_ns"]), int(event["end_ns"])))
            ran_by_pid[event["pid"]].append((int(event["start_ns"]), int(event["end_ns"]),
                                             int(event.get("ran_ns", event["end_ns"] - event["start_ns"]))))
    for pid, kernels in kernels_by_pid.items():
        if not kernels:
            raise AssertionError(f"the trace has no kernel events of pid {pid} on device {device}")
    window_start = max(min(start for start, _ in kernels) for kernels in kernels_by_pid.values())
    window_end = min(max(end for _, end in kernels) for kernels in kernels_by_pid.values())
    if window_end <= window_start:
        raise AssertionError(f"the kernels of pids {pids} never overlap in time: window "
                             f"[{window_start}, {window_end}] ns")
    clipped_by_pid = {
        pid: [(max(start, window_start), min(end, window_end)) for start, end in kernels
              if end > window_start and start < window_end]
        for pid, kernels in kernels_by_pid.items()
    }
    # A kernel preempted by another process's slices spans them: its span is not its device time. The time it ran
    # (ran_ns, pro-rated to the part of its span inside the window) bounds it; the union of spans bounds a process
    # whose streams run kernels at once.
    ran = {pid: sum(r * (min(e, window_end) - max(s, window_start)) / (e - s) if e > s else 0
                    for s, e, r in kernels if e > window_start and s < window_end)
           for pid, kernels in ran_by_pid.items()}
    busy = {pid: min(_union_length(clipped), int(ran[pid])) for pid, clipped in clipped_by_pid.items()}
    device_busy = min(_union_length([interval for clipped in clipped_by_pid.values() for interval in clipped]),
                      sum(busy.values()))
    return KernelShares(window_start, window_end, busy, device_busy)


class MonitorProcess:
    """vgpu-monitor on a test's fake machine (docs/node-monitor.md): a containers folder holding one container, `box`,
    whose cgroup is the test's own (every process the test starts is in it), a verdicts folder, and the monitor's log.
    Started outside any container (no shim); pytest skips where the monitor is not built."""

    def __init__(self, fake_gpu: FakeGpu, binary: Path, work_dir: Path) -> None:
        if not binary.exists():
            import pytest
            pytest.skip(f"{binary} is not built")
        self.fake_gpu = fake_gpu
        self.binary = binary
        self.containers = work_dir / "containers"
        self.verdicts = work_dir / "verdicts"
        self.containers.mkdir()
        self.verdict_path = self.verdicts / "box" / "verdict"
        self.log_path = work_dir / "monitor.log"
        self.process: subprocess.Popen | None = None
        self._log = None

    def contain(self, *lines: str) -> None:
        """Writes box's container file: its cgroup (the test's own), then `lines` (its limits, KEY=VALUE)."""
        cgroup = subprocess.run([str(self.binary), "--cgroup-of", str(os.getpid())], check=True, capture_output=True,
                                text=True).stdout.strip()
        (self.containers / "box.conf").write_text("\n".join([f"VGPU_CGROUP={cgroup}", *lines]) + "\n")

    def start(self, *flags: str) -> None:
        env = {name: value for name, value in self.fake_gpu.env.items() if name != "LD_PRELOAD"}
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [str(self.binary), "--containers", str(self.containers), "--verdicts", str(self.verdicts), *flags],
            env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_for(self, predicate, timeout: float, what: str):
        """The first true value of `predicate()` within `timeout` s; fails naming `what` (and the log) otherwise, or
        as soon as the monitor exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"vgpu-monitor exited with {self.process.returncode}: {self.log()}")
            time.sleep(0.01)
        raise AssertionError(f"no {what} within {timeout} s; monitor log:\n{self.log()}")

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 10 s; the exit status (None: never started)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode
