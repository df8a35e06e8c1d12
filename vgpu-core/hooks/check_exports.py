#!/usr/bin/env python3
"""Checks that libvgpu.so exports exactly the hooks of hook_table.h plus dlsym (no internal symbol leaks)."""
import re
import subprocess
import sys

library, table = sys.argv[1], sys.argv[2]
exports_dlsym = len(sys.argv) < 4 or sys.argv[3] not in ("0", "OFF", "FALSE")
text = open(table, encoding="utf-8").read()
expected = {"dlsym"} if exports_dlsym else set()
for block in ("VGPU_CUDA_HOOKS", "VGPU_NVML_HOOKS"):
    start = text.index(f"#define {block}(X)")
    expected |= set(re.findall(r"X\((\w+)\)", text[start:text.index("\n\n", start)]))
output = subprocess.run(["nm", "-D", "--defined-only", library], check=True, capture_output=True, text=True).stdout
exported = {line.split()[-1].split("@")[0] for line in output.splitlines()
            if len(line.split()) >= 3 and line.split()[1] != "A"}  # every defined symbol but version nodes
missing, extra = expected - exported, exported - expected
for name in sorted(missing):
    print(f"not exported but in hook_table.h: {name}")
for name in sorted(extra):
    print(f"exported but not a hook: {name}")
print(f"{len(exported)} exported, {len(expected)} expected")
sys.exit(1 if missing or extra else 0)
