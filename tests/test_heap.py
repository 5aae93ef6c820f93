"""swarm/heap.py: freed heap that glibc keeps resident is handed back. In a process of its own (the
allocator's settings are the whole process's): large blocks served from the heap, as glibc serves
them once it has freed larger ones, freed, then trimmed."""

import subprocess
import sys

import pytest

from swarm.heap import _malloc_trim

SCRIPT = r"""
import ctypes, ctypes.util, os
from swarm.heap import give_back_free_heap
libc = ctypes.CDLL(ctypes.util.find_library("c"))
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)  # blocks up to 1 GiB from the heap, as after glibc's threshold rose
libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)  # and not trimmed by free() itself
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
blocks = [libc.malloc(64 << 20) for _ in range(4)]
for block in blocks:
    ctypes.memset(block, 1, 64 << 20)
guard = libc.malloc(1 << 20)  # a live block above them: free() alone cannot shrink the heap's top
for block in blocks:
    libc.free(block)
freed = rss()
assert give_back_free_heap()
print(freed - rss())
"""


@pytest.mark.skipif(_malloc_trim() is None, reason="not glibc: nothing to trim with")
def test_freed_heap_is_handed_back():
    given_back = int(subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout)
    assert given_back > 200 << 20, f"{given_back / 2**20:.0f} MiB handed back of 256 MiB freed"
