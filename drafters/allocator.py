"""Keep freed memory in the process: glibc's malloc settings for the trainers' and decoders' allocation pattern.

PyTorch's CPU allocator is glibc's malloc. A training step allocates and frees the same large buffers again and
again (SmolLM2: the target's label logits 512 x 49,152 x 4 B = 100 MB, the draft logits, their softmax and
gradients per TTT step). glibc serves every block above its mmap threshold (at most 32 MiB) with a fresh mmap and
gives it back with munmap on free, and trims the top of the heap above 128 KiB: so each step maps, zero-fills
(one minor page fault per 4 KiB page) and unmaps hundreds of MB. Measured on SmolLM2 EAGLE-3 offline, 1 thread,
40 steps (docs/training.md "Allocator"): system time 12.2 s -> 1.5 s, CPU time 43.8 s -> 31.7 s, the same losses,
peak RSS +3%. The settings:

    M_MMAP_MAX = 0            no block is served by mmap: large blocks come from the heap and are reused
    M_TRIM_THRESHOLD = 2 GiB  the heap's top is not given back after every free (the largest value it takes)
    M_TOP_PAD = 256 MiB       the heap grows in steps of 256 MiB, not one page at a time

The cost: memory freed after the peak stays with the process until it exits.
Set DRAFTERS_MALLOC=system to keep glibc's defaults; a MALLOC_* environment variable the user set wins, and
other C libraries (musl, macOS) are left alone.
"""

import ctypes
import ctypes.util
import os
import sys

# mallopt parameter numbers from glibc's malloc.h
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
SETTINGS = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 2**31 - 1, M_TOP_PAD: 256 << 20}
USER_VARIABLES = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Apply SETTINGS to this process's glibc malloc -> whether they were applied (False: not glibc, opted out, or
    the user's own MALLOC_* settings). Call it once, early, before the large tensors exist."""
    if not sys.platform.startswith("linux") or os.environ.get("DRAFTERS_MALLOC", "keep") == "system":
        return False
    if any(name in os.environ for name in USER_VARIABLES):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS.items())
