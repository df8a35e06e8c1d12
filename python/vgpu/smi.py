"""An nvidia-smi-like view of a GPU through NVML (the real one or fakecuda's), and a summary of a fakecuda trace.

    python -m vgpu.smi                      # the GPUs and their processes, as nvidia-smi shows them
    python -m vgpu.smi --fake               # the same of a fresh fake machine (fakecuda's libnvidia-ml.so.1)
    python -m vgpu.smi --trace-summary FILE # per-process kernel time from a FAKECUDA_TRACE file

Exit status: 0 shown; 1 NVML (or, with --fake, fakecuda) could not be loaded or started; 2 a bad argument or an
unreadable trace.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict

from . import _paths

MIB = 1024 * 1024
# What nvidia-ml-py dlopens on Linux, by name: the dynamic loader's search decides which one (LD_LIBRARY_PATH first).
NVML_LIBRARY = "libnvidia-ml.so.1"
FAKE_NVML = "lib/" + NVML_LIBRARY  # under a build folder or an install dir (vgpu._paths)
FAKE_VIEW_TIMEOUT_S = 60
BUILD_HINT = "build it: `bash .ci/setup`, or `cmake --preset default && cmake --build --preset default`"
EXIT_SHOWN, EXIT_NO_NVML, EXIT_BAD_INPUT = 0, 1, 2


class NvmlUnavailable(Exception):
    """NVML could not be used. stage: "pynvml" (not installed), "load" (dlopen failed) or "init" (nvmlInit failed);
    library: the file that was loaded, when it was."""

    def __init__(self, stage: str, detail: str, library: str | None = None):
        super().__init__(detail)
        self.stage, self.detail, self.library = stage, detail, library


def _loaded_path(name: str) -> str | None:
    """Where this process mapped a library whose file name starts with `name` (from /proc/self/maps), else None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)  # address perms offset device inode [path]
                path = fields[5].strip() if len(fields) == 6 else ""
                if os.path.basename(path).startswith(name):
                    return path
    except OSError:
        pass
    return None


def start_nvml():
    """Loads libnvidia-ml.so.1 as pynvml would and initialises it; returns the pynvml module.

    Raises NvmlUnavailable with what failed: pynvml missing, the library not found by the loader (with dlopen's
    message, which pynvml drops), or nvmlInit refusing (with the file that was loaded).
    """
    try:
        import pynvml  # imported here so --trace-summary works without NVML
    except ImportError as error:
        raise NvmlUnavailable("pynvml", f"pynvml is not installed ({error}); pip install nvidia-ml-py, "
                                        "or pip install 'vgpu[smi]'") from None
    try:
        ctypes.CDLL(NVML_LIBRARY)  # the handle pynvml's own CDLL(NVML_LIBRARY) gets next
    except OSError as error:
        raise NvmlUnavailable("load", str(error)) from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        raise NvmlUnavailable("init", str(error), _loaded_path(NVML_LIBRARY)) from None
    return pynvml


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def render_devices() -> str:
    """Returns the nvidia-smi-like table for every device NVML reports."""
    pynvml = start_nvml()
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        width = 100

        def row(text: str) -> str:
            return f"| {text:<{width - 4}} |"

        rule = "+" + "-" * (width - 2) + "+"
        lines = [
            rule,
            row(f"vgpu smi   Driver Version: {driver}   CUDA Version: {cuda // 1000}.{cuda % 1000 // 10}"),
            row(f"{'GPU':>3}  {'Name':<24}  {'Bus-Id':<12}  {'Temp':>4}  {'Power':>11}  {'Memory-Usage':>22}  {'GPU-Util':>8}"),
            "+" + "=" * (width - 2) + "+",
        ]
        processes = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = _text(pynvml.nvmlDeviceGetName(handle))
            bus = _text(pynvml.nvmlDeviceGetPciInfo(handle).busId)
            temperature = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
            power = pynvml.nvmlDeviceGetPowerUsage(handle) // 1000
            limit = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) // 1000
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            utilization = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
            memory_text = f"{memory.used // MIB}MiB / {memory.total // MIB}MiB"
            lines.append(row(f"{index:>3}  {name[:24]:<24}  {bus[-12:]:<12}  {temperature:>3}C  "
                             f"{f'{power}W / {limit}W':>11}  {memory_text:>22}  {utilization:>7}%"))
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                try:
                    pname = _text(pynvml.nvmlSystemGetProcessName(process.pid))
                except pynvml.NVMLError:
                    pname = "?"
                used = (process.usedGpuMemory or 0) // MIB
                processes.append(row(f"{index:>3}  {process.pid:>8}  {'C':>4}  {pname[-52:]:<52}  {f'{used}MiB':>14}"))
        lines += [rule, row("Processes:"),
                  row(f"{'GPU':>3}  {'PID':>8}  {'Type':>4}  {'Process name':<52}  {'GPU Memory':>14}")]
        lines += processes or [row("No running processes found")]
        lines.append(rule)
        return "\n".join(lines)
    finally:
        pynvml.nvmlShutdown()


def summarize_trace(path: str) -> dict:
    """Per-process kernel counts and device time from a FAKECUDA_TRACE file, over the interval all ran."""
    kernels = defaultdict(list)
    with open(path, encoding="utf-8") as trace:
        for number, line in enumerate(trace, 1):
            try:
                event = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not a JSON line ({error})") from None
            if event.get("ev") == "kernel":
                kernels[event["pid"]].append((event["start_ns"], event["end_ns"]))
    if not kernels:
        return {"processes": {}, "window_s": 0.0}
    start = max(min(s for s, _ in spans) for spans in kernels.values())
    end = min(max(e for _, e in spans) for spans in kernels.values())
    window = max(end - start, 1)
    result = {}
    for pid, spans in sorted(kernels.items()):
        busy = sum(max(0, min(e, end) - max(s, start)) for s, e in spans)
        result[pid] = {"kernels": len(spans), "busy_s": busy / 1e9, "share": busy / window}
    return {"processes": result, "window_s": window / 1e9}


def explain_no_nvml(error: NvmlUnavailable) -> str:
    """The block `vgpu smi` prints when NVML is not there: what was looked for, what failed, and the ways on."""
    if error.stage == "pynvml":
        return f"vgpu smi: NVML is not available: {error.detail}"
    search_path = os.environ.get("LD_LIBRARY_PATH") or "(unset)"
    if error.stage == "load":
        lines = [f"vgpu smi: NVML is not available: {NVML_LIBRARY} did not load: {error.detail}",
                 f"  looked for {NVML_LIBRARY} (the NVIDIA driver's) through the dynamic loader, as pynvml does: "
                 f"LD_LIBRARY_PATH={search_path}, then /etc/ld.so.cache and the system library folders"]
    else:
        lines = [f"vgpu smi: NVML is not available: nvmlInit failed: {error.detail}",
                 f"  looked for {NVML_LIBRARY} through the dynamic loader (LD_LIBRARY_PATH={search_path}): loaded "
                 f"{error.library or 'a copy whose path could not be read'}, whose nvmlInit failed"]
    fake, tried = _paths.find_built(FAKE_NVML)
    fake_text = (f"the fake machine of fakecuda ({fake})" if fake is not None else
                 f"the fake machine of fakecuda, which is not built here (tried {', '.join(map(str, tried))}; "
                 f"{BUILD_HINT})")
    lines += ["  without a GPU:",
              f"    vgpu smi --fake          {fake_text}",
              "    vgpu smi --region PATH   a container's region file (its CUDA_DEVICE_MEMORY_SHARED_CACHE), "
              "read without NVML"]
    return "\n".join(lines)


def _fake_view() -> int:
    """The child process of `vgpu smi --fake`: the view, with LD_LIBRARY_PATH and FAKECUDA_STATE already set."""
    try:
        print(render_devices())
    except NvmlUnavailable as error:
        print(f"vgpu smi --fake: fakecuda's NVML ({error.library or NVML_LIBRARY}) did not start: {error.detail} "
              f"(FAKECUDA_STATE={os.environ.get('FAKECUDA_STATE')}, FAKECUDA_DEVICES="
              f"{os.environ.get('FAKECUDA_DEVICES') or '(unset: h100-80gb)'}; fakecuda's reason, if it gave one, is "
              f"above)", file=sys.stderr)
        return EXIT_NO_NVML
    except Exception as error:  # a query of fakecuda's NVML failing midway
        print(f"vgpu smi --fake: an NVML query failed: {type(error).__name__}: {error}", file=sys.stderr)
        return EXIT_NO_NVML
    return EXIT_SHOWN


def show_fake() -> int:
    """`vgpu smi --fake`: the view of a fake machine, run in a child process whose loader finds fakecuda's NVML.

    The machine is $FAKECUDA_STATE when set (e.g. one a live run is using), else a fresh one in a temporary folder,
    removed afterwards; a fresh machine's devices are $FAKECUDA_DEVICES (default: one h100-80gb).
    """
    library, tried = _paths.find_built(FAKE_NVML)
    if library is None:
        print(f"vgpu smi --fake: fakecuda's {NVML_LIBRARY} is not built here; tried "
              f"{', '.join(map(str, tried)) or '(nowhere: no build folder or install dir is known)'}\n"
              f"  {BUILD_HINT}; or set VGPU_BUILD_DIR to a build folder, or VGPU_INSTALL_DIR to an install dir "
              f"(with lib/{NVML_LIBRARY})", file=sys.stderr)
        return EXIT_NO_NVML
    environment = dict(os.environ)
    environment["LD_LIBRARY_PATH"] = os.pathsep.join(
        [str(library.parent)] + ([environment["LD_LIBRARY_PATH"]] if environment.get("LD_LIBRARY_PATH") else []))
    package_root = str(_paths.PACKAGE_DIR.parent)  # so the child imports this very package
    environment["PYTHONPATH"] = os.pathsep.join(
        [package_root] + ([environment["PYTHONPATH"]] if environment.get("PYTHONPATH") else []))
    with tempfile.TemporaryDirectory(prefix="vgpu-smi-fake-") as temporary:
        given = os.environ.get("FAKECUDA_STATE")
        environment["FAKECUDA_STATE"] = given or os.path.join(temporary, "machine.state")
        devices = os.environ.get("FAKECUDA_DEVICES") or "h100-80gb"
        machine = (f"FAKECUDA_STATE={given}" if given else
                   f"a fresh machine of {devices} (FAKECUDA_STATE={environment['FAKECUDA_STATE']}, removed afterwards)")
        print(f"fakecuda: {machine}; NVML from {library}", flush=True)
        try:
            child = subprocess.run([sys.executable, "-c", "import sys; from vgpu.smi import _fake_view; "
                                                          "sys.exit(_fake_view())"],
                                   env=environment, timeout=FAKE_VIEW_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            print(f"vgpu smi --fake: the view of the fake machine took more than {FAKE_VIEW_TIMEOUT_S} s; stopped",
                  file=sys.stderr)
            return EXIT_NO_NVML
    return child.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vgpu-smi", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    view = parser.add_mutually_exclusive_group()
    view.add_argument("--fake", action="store_true",
                      help="the fake machine of fakecuda (this build's or the installed package's) instead of the "
                           "GPU: $FAKECUDA_STATE if set, else a fresh one of $FAKECUDA_DEVICES (default h100-80gb)")
    view.add_argument("--trace-summary", metavar="FILE", help="summarize a FAKECUDA_TRACE file instead")
    parser.add_argument("--json", action="store_true", help="print the trace summary as JSON")
    args = parser.parse_args(argv)
    if args.fake:
        return show_fake()
    if args.trace_summary:
        try:
            summary = summarize_trace(args.trace_summary)
        except (OSError, ValueError, KeyError) as error:
            print(f"vgpu smi: cannot read trace {args.trace_summary}: {error}", file=sys.stderr)
            return EXIT_BAD_INPUT
        if args.json:
            print(json.dumps(summary))
            return EXIT_SHOWN
        print(f"== device time per process over the {summary['window_s']:.2f} s in which all of them ran kernels")
        for pid, row in summary["processes"].items():
            print(f"   pid {pid:>8}: {row['kernels']:>6} kernels, {row['busy_s']:.3f} s busy, share {row['share']:.1%}")
        return EXIT_SHOWN
    try:
        print(render_devices())
    except NvmlUnavailable as error:
        print(explain_no_nvml(error), file=sys.stderr)
        return EXIT_NO_NVML
    except Exception as error:  # an NVML query failing midway: say which, do not dump a traceback
        print(f"vgpu smi: an NVML query failed: {type(error).__name__}: {error}", file=sys.stderr)
        return EXIT_NO_NVML
    return EXIT_SHOWN


if __name__ == "__main__":
    sys.exit(main())
