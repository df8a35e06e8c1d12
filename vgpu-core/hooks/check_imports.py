#!/usr/bin/env python3
"""Checks that libvgpu.so cannot change its host process behind the program's back: it imports no function that
ends the process or changes process-wide state (signal dispositions and masks, umask, limits, working folder,
environment, identity), and its own sources call neither abort() nor exit().

`abort` is imported, by the statically linked C++ runtime (std::terminate, reached only if an exception left a hook:
every hook catches, docs/shim.md "Out of host memory"); `kill` is imported for kill(pid, 0), a liveness probe that
sends nothing (vgpu-core/region/region.cc), and is checked to be called with 0 only; `prctl` is imported for the
calling thread's timer slack (SleepUntilNs: tightened while the shim sleeps, the thread's own put back), and is checked
to be called with PR_GET_TIMERSLACK or PR_SET_TIMERSLACK only.

usage: check_imports.py LIBVGPU_SO VGPU_CORE_FOLDER
"""
import re
import subprocess
import sys
from pathlib import Path

FORBIDDEN = {
    # ending the process
    "exit", "_exit", "_Exit", "quick_exit", "at_quick_exit", "atexit", "on_exit", "raise", "pthread_exit",
    # signals
    "signal", "sigaction", "sigprocmask", "pthread_sigmask", "sigset", "bsd_signal", "sysv_signal", "sigaltstack",
    "pthread_kill", "tgkill", "killpg",
    # process-wide state
    "umask", "setrlimit", "prlimit", "prlimit64", "chdir", "fchdir", "chroot", "setenv", "putenv", "unsetenv",
    "clearenv", "setsid", "setpgid", "setpriority", "nice",
    "setuid", "setgid", "seteuid", "setegid", "setreuid", "setregid", "setresuid", "setresgid", "setgroups",
    # new processes
    "fork", "vfork", "system", "popen", "execve", "execv", "execvp", "execvpe", "execl", "execlp", "execle",
    "posix_spawn", "posix_spawnp",
}

library, sources = sys.argv[1], Path(sys.argv[2])
output = subprocess.run(["nm", "-D", "--undefined-only", library], check=True, capture_output=True, text=True).stdout
imported = {line.split()[-1].split("@")[0] for line in output.splitlines() if line.strip()}
problems = [f"imports {name}" for name in sorted(imported & FORBIDDEN)]

# A call of the C function, plain or std:: or ::, not a member or another namespace's function of the same name.
call = re.compile(r"(?<![\w.>:])(?:(?:std)?::)?(abort|exit|_exit|_Exit|quick_exit|kill|prctl)\s*\(([^)]*)\)")
# vgpu-core/monitor is vgpu-monitor, a program of its own on the host (it exits, and kills by design): not linked
# into libvgpu.so, so not read here (nm above would show what of it the library took).
MONITOR = sources / "monitor"
for path in sorted(sources.rglob("*.cc")) + sorted(sources.rglob("*.h")):
    if MONITOR in path.parents:
        continue
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        code = line.split("//", 1)[0]
        for match in call.finditer(code):
            name, arguments = match.group(1), match.group(2)
            if name == "kill" and re.fullmatch(r"\s*\w+\s*,\s*0\s*", arguments):
                continue  # kill(pid, 0): a liveness probe
            if name == "prctl" and re.match(r"\s*PR_(GET|SET)_TIMERSLACK\s*,", arguments):
                continue  # the calling thread's timer slack
            problems.append(f"{path}:{number}: calls {name}({arguments})")

for problem in problems:
    print(problem)
print(f"{len(imported)} imported symbols checked against {len(FORBIDDEN)} forbidden; sources under {sources} read")
sys.exit(1 if problems else 0)
