"""drafters.allocator: a process that frees and reallocates a large block (what a training step does with its
logits) stops paying a page fault per 4 KiB page for it, and the opt-outs leave glibc's defaults alone."""

import subprocess
import sys

import pytest

# 20 times: a 100 MB block, written through (zero-filled pages fault on first touch), then freed
CHURN = """
import resource, sys
from drafters.allocator import keep_freed_memory
applied = keep_freed_memory()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    block = bytearray(100 * 2**20)
    del block
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def churn(**env) -> tuple[bool, int]:
    done = subprocess.run([sys.executable, "-c", CHURN], capture_output=True, text=True, check=True,
                          env={"PATH": "/usr/bin:/bin", **env})
    applied, faults = done.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings: Linux only")
def test_a_freed_large_block_is_reused_instead_of_mapped_again():
    kept, kept_faults = churn()
    system, system_faults = churn(DRAFTERS_MALLOC="system")
    assert kept and not system
    pages = 100 * 2**20 // 4096
    assert system_faults > 15 * pages  # glibc's default: a fresh mmap, every page faulting, each time
    assert kept_faults < 3 * pages  # kept: the first block's pages fault once, the next 19 reuse them


def test_the_users_own_malloc_settings_win():
    applied, _ = churn(MALLOC_ARENA_MAX="2", MALLOC_MMAP_THRESHOLD_="1048576")
    assert not applied
