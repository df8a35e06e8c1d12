"""An nvidia-smi-like view of a GPU through NVML (the real one or fakecuda's), and a summary of a fakecuda trace.

    python -m vgpu.smi                      # the GPUs and their processes, as nvidia-smi shows them
    python -m vgpu.smi --trace-summary FILE # per-process kernel time from a FAKECUDA_TRACE file
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

MIB = 1024 * 1024


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def render_devices() -> str:
    """Returns the nvidia-smi-like table for every device NVML reports."""
    import pynvml  # imported here so --trace-summary works without NVML

    pynvml.nvmlInit()
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vgpu-smi", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace-summary", metavar="FILE", help="summarize a FAKECUDA_TRACE file instead")
    parser.add_argument("--json", action="store_true", help="print the trace summary as JSON")
    args = parser.parse_args(argv)
    if args.trace_summary:
        try:
            summary = summarize_trace(args.trace_summary)
        except (OSError, ValueError, KeyError) as error:
            print(f"vgpu-smi: cannot read trace {args.trace_summary}: {error}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(summary))
            return 0
        print(f"== device time per process over the {summary['window_s']:.2f} s in which all of them ran kernels")
        for pid, row in summary["processes"].items():
            print(f"   pid {pid:>8}: {row['kernels']:>6} kernels, {row['busy_s']:.3f} s busy, share {row['share']:.1%}")
        return 0
    try:
        print(render_devices())
    except Exception as error:  # NVML missing or failing: say so, do not dump a traceback
        print(f"vgpu-smi: NVML is not available: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
