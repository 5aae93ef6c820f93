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


# a peer's stand-in: its main process sleeps while a child of its own (as a DHT process would) spins
# once GO exists, reports the CPU seconds it spent, and lingers (its seconds stay countable)
CHILD = ("import os, sys, time\n"
         "while not os.path.exists(sys.argv[1]):\n"
         "    time.sleep(0.01)\n"
         "end = time.monotonic() + 1.0\n"
         "while time.monotonic() < end:\n"
         "    pass\n"
         "print('spent', time.process_time(), flush=True)\n"
         "time.sleep(5)\n")
PARENT = ("import subprocess, sys\n"
          "child = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]])\n"
          "print('started', flush=True)\n"
          "child.wait()\n")


def test_process_cpu_gives_a_peers_seconds_to_the_process_that_spent_them(tmp_path):
    go = tmp_path / "go"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(go)], stdout=subprocess.PIPE, text=True)
    processes = cpu = None
    try:
        assert parent.stdout.readline().strip() == "started"
        time.sleep(0.3)  # the child is running (and idle)
        processes, cpu = ProcessCpu([parent.pid]), CpuUse()
        time.sleep(3 * PROCESS_SAMPLE_S)
        start = time.time()
        go.touch()
        word, spent = parent.stdout.readline().split()
        time.sleep(3 * PROCESS_SAMPLE_S)
        end = time.time()
        time.sleep(3 * PROCESS_SAMPLE_S)  # a sample after the window
        seconds = processes.seconds(start, end)
        # the child's seconds, as it counted them itself (however loaded the cores: a share of its second)
        assert word == "spent" and float(spent) > 0.1
        assert 0.7 * float(spent) <= seconds["helper"] <= 1.1 * float(spent) + 0.05
        assert seconds["peer"] < 0.2 and seconds["p2pd"] == 0.0  # the sleeping main process; no daemon
        assert cpu.busy_seconds(start, end) >= 0.7 * seconds["helper"]  # everything, the child included
    finally:
        for counters in (processes, cpu):
            if counters is not None:
                counters.close()
        stop_family(parent)


def stop_family(parent: subprocess.Popen) -> None:
    """Kill the test's own parent process and the child it started."""
    import psutil

    try:
        children = psutil.Process(parent.pid).children(recursive=True)
    except psutil.Error:
        children = []
    for proc in children:
        try:
            proc.kill()
        except psutil.Error:
            pass
    parent.kill()
    parent.wait(30)
