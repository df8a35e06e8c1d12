"""The `vgpu` command: run and check scenarios, show GPUs and container regions.

    vgpu run SCENARIO [--mode virtual|live] [--plot FILE] [--trace FILE] [--json] [--quiet]
    vgpu check SCENARIO... [--json]
    vgpu smi [--fake | --region PATH... | --trace-summary FILE] [--json]

Exit status of `vgpu run`: 0 every expectation held, 1 some did not, 2 the scenario was refused or the run could not
be done, 130 interrupted (Ctrl-C). `vgpu check`: 2 if any file has a problem, else 0. `vgpu smi`: 0 shown, 1 NVML
(with --fake: fakecuda) could not be loaded or started, 2 a region or trace could not be read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import __version__
from ._errors import NativeUnavailable, RegionError, ScenarioError

EXIT_PASSED, EXIT_FAILED, EXIT_REFUSED, EXIT_INTERRUPTED = 0, 1, 2, 130


def version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version as installed_version
        try:
            return installed_version("vgpu")
        except PackageNotFoundError:
            pass
    except ImportError:  # pragma: no cover
        pass
    return __version__


def _say(message: str) -> None:
    print(f"vgpu: {message}", file=sys.stderr)


class Progress:
    """Progress on stderr, shown only once a run has taken more than `after_s` of wall time."""

    def __init__(self, stream=None, after_s: float = 2.0, enabled: bool = True):
        self.stream = stream if stream is not None else sys.stderr
        self.after_s = after_s
        self.enabled = enabled
        self.start = time.monotonic()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.last_write = 0.0
        self.last_step = -1
        self.shown = False

    def __call__(self, fraction: float, what: str) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.start < self.after_s and fraction < 1.0:
            return
        if not self.shown and fraction >= 1.0:
            return  # finished before the threshold: nothing to show
        percent = max(0.0, min(1.0, fraction)) * 100
        if self.tty:
            if now - self.last_write < 0.1 and fraction < 1.0:
                return
            self.stream.write(f"\r  {percent:5.1f} %  {what[:60]:<60}")
        else:
            step = int(percent // 10)
            if step == self.last_step:
                return
            self.last_step = step
            self.stream.write(f"  {percent:5.1f} %  {what}\n")
        self.stream.flush()
        self.last_write = now
        self.shown = True

    def finish(self) -> None:
        if self.shown and self.tty:
            self.stream.write("\n")
            self.stream.flush()
        self.shown = False


def _print_problems(problems) -> None:
    for problem in problems:
        print(str(problem), file=sys.stderr)


def cmd_run(args: argparse.Namespace) -> int:
    from . import scenario as scenarios

    def refused(message: str, problems=()) -> int:
        _print_problems(problems)
        if message:
            _say(message)
        if args.json:
            print(json.dumps({"ok": False, "error": message, "problems": [p.to_dict() for p in problems]}))
        return EXIT_REFUSED

    try:
        scenario = scenarios.load(args.scenario)
    except ScenarioError as error:
        return refused(f"{args.scenario}: refused ({len(error.problems)} problem"
                       f"{'s' if len(error.problems) != 1 else ''})", error.problems)
    except NativeUnavailable as error:
        return refused(str(error))
    mode = args.mode or scenarios.default_mode(scenario)
    if mode not in scenario.modes:
        return refused(f"{args.scenario}: the scenario is meant for {', '.join(scenario.modes)} mode, not {mode} "
                       f"(its `mode:` key)")

    progress = Progress(enabled=not args.quiet)
    try:
        outcome = scenarios.run(scenario, mode=mode, trace_path=args.trace, install_dir=args.install_dir,
                                work_dir=args.work_dir, progress=progress)
    except KeyboardInterrupt:
        progress.finish()
        _say(f"{args.scenario}: interrupted")
        return EXIT_INTERRUPTED
    finally:
        progress.finish()
    if not outcome.ok:
        return refused(f"{args.scenario}: the {mode} run did not complete: {outcome.error or 'no reason given'}")

    from .analysis import format_report, summarize
    from .trace import TraceError, parse_trace, read_trace
    try:
        trace = read_trace(args.trace) if args.trace else parse_trace(outcome.trace, f"<{scenario.name} trace>")
    except (OSError, TraceError) as error:
        return refused(f"cannot read the run's trace back: {error}")
    report = summarize(trace, scenario, mode=mode, tolerance=args.tolerance)

    if args.plot:
        from .plot import plot
        try:
            plot(trace, report, args.plot)
        except OSError as error:
            _say(f"cannot write the plot {args.plot}: {error}")
            return EXIT_REFUSED

    if args.json:
        result = report.to_dict()
        result.update(ok=True, wall_seconds=outcome.wall_seconds, trace=args.trace, plot=args.plot)
        print(json.dumps(result))
    else:
        print(format_report(report))
        if not args.quiet:
            where = [f"trace {args.trace}"] if args.trace else []
            where += [f"plot {args.plot}"] if args.plot else []
            print(f"({outcome.wall_seconds:.1f} s of wall time{'; ' if where else ''}{', '.join(where)})")
    return EXIT_PASSED if report.passed else EXIT_FAILED


def cmd_check(args: argparse.Namespace) -> int:
    from . import scenario as scenarios

    results = []
    any_problem = False
    for path in args.scenarios:
        try:
            loaded = scenarios.load(path)
            results.append({"file": path, "ok": True, "name": loaded.name, "problems": []})
            if not args.json and not args.quiet:
                print(f"{path}: ok ({loaded.name}: {len(loaded.tenants)} tenant"
                      f"{'s' if len(loaded.tenants) != 1 else ''}, {loaded.duration_ns / 1e9:g} s, "
                      f"{', '.join(loaded.modes)})")
        except ScenarioError as error:
            any_problem = True
            _print_problems(error.problems)
            results.append({"file": path, "ok": False, "name": None,
                            "problems": [p.to_dict() | {"text": str(p)} for p in error.problems]})
        except NativeUnavailable as error:
            _say(str(error))
            return EXIT_REFUSED
    if args.json:
        print(json.dumps({"ok": not any_problem, "files": results}))
    return EXIT_REFUSED if any_problem else EXIT_PASSED


def render_region(region: dict) -> str:
    from .analysis import format_bytes

    live = region.get("live", [])
    lines = [f"region {region['path']} (layout version {region['version']}), {len(live)} live process"
             f"{'es' if len(live) != 1 else ''}"]
    header = ("dev", "uuid", "used / limit", "context", "share", "cap")
    rows = [header]
    for device in region.get("devices", []):
        share = device.get("share_percent")
        cap = device.get("cap_percent")
        limit = device["limit_bytes"]
        rows.append((str(device["index"]), device["uuid"],
                     f"{format_bytes(device['used_bytes'])} / {format_bytes(limit) if limit else 'none'}",
                     format_bytes(device["context_bytes"]), "-" if share is None else f"{share:.1f} %",
                     "-" if cap is None or cap >= 100 else f"{cap:g} %"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for process in live:
        used = ", ".join(f"{format_bytes(b)} on device {d}" for d, b in enumerate(process["used_bytes"]) if b)
        lines.append(f"  pid {process['pid']}: {used or 'no device memory'}")
    return "\n".join(lines)


def cmd_smi(args: argparse.Namespace) -> int:
    if not args.region:
        from . import smi
        forwarded = (["--trace-summary", args.trace_summary] if args.trace_summary else []) + \
                    (["--fake"] if args.fake else []) + (["--json"] if args.json else [])
        return smi.main(forwarded)
    from . import scenario as scenarios
    regions = []
    status = EXIT_PASSED
    for path in args.region:
        try:
            regions.append(scenarios.read_region(path))
        except (RegionError, OSError) as error:
            _say(f"cannot read the region {path}: {error}")
            status = EXIT_REFUSED
        except NativeUnavailable as error:
            _say(str(error))
            return EXIT_REFUSED
    if args.json:
        print(json.dumps({"regions": regions}))
    else:
        print("\n\n".join(render_region(region) for region in regions))
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vgpu", description="GPU slicing for containers: run and check scenarios (docs/scenarios.md), show "
                                 "GPUs and container regions.",
        epilog="`vgpu COMMAND --help` describes each command.")
    parser.add_argument("--version", action="version", version=f"vgpu {version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = commands.add_parser(
        "run", help="run a scenario and judge its expectations",
        description="Runs a scenario (virtual: the simulator under a virtual clock; live: real processes under the "
                    "shim over fakecuda or a real GPU), prints a summary per tenant and every expectation checked. "
                    "Exit status: 0 every expectation held, 1 some did not, 2 refused or could not run, "
                    "130 interrupted.")
    run.add_argument("scenario", metavar="SCENARIO", help="the scenario file (.yaml)")
    run.add_argument("--mode", choices=("virtual", "live"),
                     help="virtual or live (default: virtual if the scenario allows it, else live)")
    run.add_argument("--plot", metavar="FILE", help="write a PNG: share vs cap per tenant over time, memory vs limit")
    run.add_argument("--trace", metavar="FILE", help="keep the trace (JSON lines) in this file")
    run.add_argument("--json", action="store_true", help="print the summary and the checks as one JSON object")
    run.add_argument("--quiet", action="store_true", help="no progress on stderr and no closing line")
    run.add_argument("--tolerance", type=float, metavar="POINTS",
                     help="default tolerance of share expectations (default: 2 virtual, 3 live)")
    run.add_argument("--install-dir", metavar="DIR",
                     help="where lib/ and bin/ of the native pieces are (default: see vgpu._paths)")
    run.add_argument("--work-dir", metavar="DIR", help="temporary files of the run (default: a new folder in TMPDIR)")
    run.set_defaults(handler=cmd_run)

    check = commands.add_parser(
        "check", help="validate scenario files",
        description="Validates scenario files; prints each problem as FILE:LINE: KEY: MESSAGE on stderr. Exit "
                    "status 2 if any file has a problem, else 0.")
    check.add_argument("scenarios", metavar="SCENARIO", nargs="+", help="scenario files (.yaml)")
    check.add_argument("--json", action="store_true", help="print the results as one JSON object on stdout")
    check.add_argument("--quiet", action="store_true", help="print nothing for valid files")
    check.set_defaults(handler=cmd_check)

    smi = commands.add_parser(
        "smi", help="an nvidia-smi-like view (NVML), or container regions",
        description="Without options: the GPUs and their processes through NVML (the real one or fakecuda's, "
                    "whichever libnvidia-ml.so.1 the dynamic loader finds); where none loads, says what it looked "
                    "for and the ways on. With --fake: the same view of a fake machine of fakecuda. With --region: "
                    "each container region's per-device memory used and limit and its measured share of GPU time "
                    "(over the last second), without NVML. Exit status: 0 shown, 1 NVML (with --fake: fakecuda) "
                    "could not be loaded or started, 2 a region or trace could not be read.")
    view = smi.add_mutually_exclusive_group()
    view.add_argument("--fake", action="store_true",
                      help="the fake machine of fakecuda (this build's or the installed package's, found as `vgpu "
                           "run` finds it): $FAKECUDA_STATE if set, else a fresh one of $FAKECUDA_DEVICES (default "
                           "h100-80gb)")
    view.add_argument("--region", metavar="PATH", action="append", default=[],
                      help="a container region file (CUDA_DEVICE_MEMORY_SHARED_CACHE); repeatable")
    view.add_argument("--trace-summary", metavar="FILE", help="summarize a FAKECUDA_TRACE file instead")
    smi.add_argument("--json", action="store_true", help="print JSON (--region, --trace-summary)")
    smi.set_defaults(handler=cmd_smi)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except BrokenPipeError:  # `vgpu run ... | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_PASSED


__all__ = ["Progress", "build_parser", "main", "render_region", "version"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
