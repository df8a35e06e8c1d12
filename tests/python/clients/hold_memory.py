"""Client that allocates device memory with cuda.bindings and holds it until its stdin closes.

usage: hold_memory.py BYTES [DEVICE]
Prints {"pid", "ptr", "bytes", "free", "total"} once the memory is held, {"released": true} at the end.
"""

import os
import sys

from cuda.bindings import driver

from clientlib import check, cuda_context, emit, wait_for_end_of_input


def main() -> None:
    size_bytes = int(sys.argv[1])
    device_ordinal = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    cuda_context(device_ordinal)
    pointer = check("cuMemAlloc", driver.cuMemAlloc(size_bytes))
    free_bytes, total_bytes = check("cuMemGetInfo", driver.cuMemGetInfo())
    emit({"pid": os.getpid(), "ptr": int(pointer), "bytes": size_bytes, "free": free_bytes, "total": total_bytes})
    wait_for_end_of_input()
    check("cuMemFree", driver.cuMemFree(pointer))
    emit({"released": True})


if __name__ == "__main__":
    main()
