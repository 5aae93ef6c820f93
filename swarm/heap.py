"""Freed heap handed back to the operating system.

A peer that holds versions frees gigabytes at a time (a whole state demoted to an undo delta, the
encoders' temporary arrays), and glibc keeps much of it mapped: its threshold for serving large
blocks from their own mappings rises with the largest block freed, so later ones come from arenas it
does not shrink. At Qwen3-0.6B shape a learner's 65 held versions take 2.77 snapshots of tracked
bytes, and its resident memory was 4.92 snapshots after the last add; trimmed after each add, 3.91
(2.91 once trimmed again after the benchmark's own work). Each trim took 13 ms (47 ms at most) of
an add's 2.33 s (benchmarks/version_memory.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (another C library: musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def give_back_free_heap() -> bool:
    """Hand the heap's free memory back to the operating system; whether this C library can."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
