"""The fan-out benchmark's own measuring parts (benchmarks/fanout_wan.py) that need no network:
how busy the cores were while a payload went out, and which processes kept them busy."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.fanout_wan import CPU_SAMPLE_S, PROCESS_SAMPLE_S, CpuUse, ProcessCpu

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


# a peer's stand-in: its main process sleeps while a child of its own spins (as a DHT process would)
PARENT = ("import subprocess, sys, time\n"
          "child = subprocess.Popen([sys.executable, '-c', {spin!r}])\n"
          "print('started', flush=True)\n"
          "child.wait()\n")


def test_process_cpu_gives_a_peers_seconds_to_the_process_that_spent_them():
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(spin=SPIN.format(s=2.0))], stdout=subprocess.PIPE,
                              text=True)
    processes = cpu = None
    try:
        assert parent.stdout.readline().strip() == "started"
        processes, cpu = ProcessCpu([parent.pid]), CpuUse()
        time.sleep(0.4)
        start = time.time()
        time.sleep(1.0)
        end = time.time()
        time.sleep(3 * PROCESS_SAMPLE_S)  # a sample after the window
        seconds = processes.seconds(start, end)
        assert 0.6 <= seconds["helper"] <= 1.1  # the spinning child: about all of one core through the window
        assert seconds["peer"] < 0.2 and seconds["p2pd"] == 0.0
        assert cpu.busy_seconds(start, end) >= 0.9 * seconds["helper"]  # everything, the child included
    finally:
        for counters in (processes, cpu):
            if counters is not None:
                counters.close()
        parent.kill()
        parent.wait(30)
