"""Fuzzing campaign (issue 7): a bounded libFuzzer run of each target of tests/fuzz (docs/fuzzing.md).

fuzz_config    the shim's configuration: the config file, LoadConfig and the environment (vgpu-core/policy)
fuzz_scenario  scenario files: the YAML-subset reader and the validator, with a round trip (sim/scenario)
fuzz_region    the region loader: Attachment::Open and ReadSnapshot on files of any content, size and kind
fuzz_verdict   the node monitor's verdict, as the shim parses it (vgpu-core/verdict, docs/node-monitor.md)

The test builds nothing: it runs the programs of the fuzz preset (`cmake --preset fuzz && cmake --build --preset
fuzz`, which .ci/setup does), found in $VGPU_FUZZ_DIR or build/fuzz/bin, and skips a target whose program is absent.
Each runs for $VGPU_FUZZ_SECONDS (default 20) over a copy of its seed corpus (tests/fuzz/corpus/<target>: the
repository is never written to) with its dictionary. A crash, a broken invariant (the targets abort), a leak, a
timeout or running out of memory fails the test with the reproducer's path (copied to $VGPU_ARTIFACTS/fuzz when that
is set) and the end of libFuzzer's output; replay one with `build/fuzz/bin/fuzz_<target> PATH`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
FUZZ_SOURCES = REPO_ROOT / "tests" / "fuzz"
FUZZ_DIR = Path(os.environ.get("VGPU_FUZZ_DIR", REPO_ROOT / "build" / "fuzz" / "bin")).resolve()
SECONDS = int(os.environ.get("VGPU_FUZZ_SECONDS", "20"))
TARGETS = ["config", "scenario", "region", "verdict"]
# One input taking longer than this is a hang (libFuzzer's -timeout): the slowest seen is a few milliseconds.
INPUT_TIMEOUT_S = 10
OUTPUT_TAIL_LINES = 60


def _last_int(pattern: str, text: str) -> int | None:
    found = re.findall(pattern, text)
    return int(found[-1]) if found else None


def _failure(target: str, output: str, artifacts: Path) -> str:
    reproducers = sorted(artifacts.glob("*"))
    written = re.findall(r"Test unit written to (\S+)", output)
    kept = []
    destination = os.environ.get("VGPU_ARTIFACTS")
    for path in reproducers:
        if destination:
            keep = Path(destination) / "fuzz" / f"{target}-{path.name}"
            keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, keep)
            kept.append(str(keep))
        else:
            kept.append(str(path))
    tail = "\n".join(output.splitlines()[-OUTPUT_TAIL_LINES:])
    return (f"fuzz_{target} found a problem; reproducer(s): {', '.join(kept) or ', '.join(written) or 'none written'} "
            f"(replay: {FUZZ_DIR}/fuzz_{target} PATH)\n--- end of libFuzzer's output ---\n{tail}")


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_fuzz(target: str, tmp_path: Path, figures) -> None:
    program = FUZZ_DIR / f"fuzz_{target}"
    if not os.access(program, os.X_OK):
        pytest.skip(f"{program} is not built (cmake --preset fuzz && cmake --build --preset fuzz; needs clang and "
                    f"libclang-rt-14-dev, see .ci/setup), or set VGPU_FUZZ_DIR to the folder of the fuzz_* programs")
    corpus = tmp_path / "corpus"
    shutil.copytree(FUZZ_SOURCES / "corpus" / target, corpus)
    seeds = sum(1 for _ in corpus.iterdir())
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    command = [str(program), f"-max_total_time={SECONDS}", f"-timeout={INPUT_TIMEOUT_S}",
               f"-artifact_prefix={artifacts}/", "-print_final_stats=1", "-detect_leaks=1"]
    dictionary = FUZZ_SOURCES / f"{target}.dict"
    if dictionary.exists():
        command.append(f"-dict={dictionary}")
    command.append(str(corpus))
    # The config and region targets write a file per input under TMPDIR: in memory (/dev/shm) where there is one, as
    # a disk file system rewritten that often makes the run wait for the disk (10x fewer runs here under load).
    in_memory = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tmp_path
    scratch = Path(tempfile.mkdtemp(prefix="vgpu-fuzz-", dir=in_memory))
    environment = dict(os.environ, TMPDIR=str(scratch))
    started = time.monotonic()
    try:
        result = subprocess.run(command, cwd=tmp_path, env=environment, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace",
                                timeout=SECONDS + 4 * INPUT_TIMEOUT_S + 120)
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout if isinstance(expired.stdout, str) else (expired.stdout or b"").decode(errors="replace")
        pytest.fail(f"fuzz_{target} did not end within {SECONDS} s + margins\n" + _failure(target, output, artifacts))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.monotonic() - started
    output = result.stdout

    crashed = (result.returncode != 0 or any(artifacts.iterdir())
               or re.search(r"ERROR: (libFuzzer|AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer)", output)
               or "runtime error:" in output or "invariant broken" in output)
    if crashed:
        figures.record(f"fuzz {target}", crashes=1, seconds=round(seconds, 1))
        pytest.fail(f"exit status {result.returncode}\n" + _failure(target, output, artifacts))

    runs = _last_int(r"stat::number_of_executed_units:\s+(\d+)", output)
    if runs is None:
        runs = _last_int(r"Done (\d+) runs in", output)
    assert runs is not None and runs > 0, "no execution count in libFuzzer's output:\n" + output[-4000:]
    coverage = _last_int(r"\bcov: (\d+)", output)
    features = _last_int(r"\bft: (\d+)", output)
    corpus_now = sum(1 for _ in corpus.iterdir())
    figures.record(f"fuzz {target}", runs=runs, seconds=round(seconds, 1), crashes=0, corpus=corpus_now, seeds=seeds,
                   cov=coverage, ft=features, execs_per_s=int(runs / max(seconds, 1e-9)))
    # The run did fuzz: the seeds were read and mutated inputs ran beyond them.
    assert runs > seeds, f"fuzz_{target} ran only {runs} inputs for {seeds} seeds:\n" + output[-4000:]
