"""The fan-out benchmark's own measuring parts (benchmarks/fanout_wan.py) that need no network:
how busy the cores were while a payload went out."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.fanout_wan import CPU_SAMPLE_S, CpuUse

SPIN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"


def test_cpu_use_reads_every_core_busy_while_each_spins():
    cpu = CpuUse()
    spinners = []
    try:
        time.sleep(3 * CPU_SAMPLE_S)
        # one process per core, each spinning 1.5 s; the window is their middle second
        spinners = [subprocess.Popen([sys.executable, "-c", SPIN.format(s=1.5)]) for _ in range(os.cpu_count() or 1)]
        time.sleep(0.3)
        start = time.time()
        time.sleep(0.9)
        end = time.time()
        for spinner in spinners:
            spinner.wait(30)
        time.sleep(3 * CPU_SAMPLE_S)  # a sample after the window
        assert 80.0 <= cpu.percent(start, end) <= 100.0
        assert len(cpu.samples) >= 10 and all(0 <= busy <= total for _, busy, total in cpu.samples)
    finally:
        for spinner in spinners:
            if spinner.poll() is None:
                spinner.kill()
                spinner.wait()
        cpu.close()
