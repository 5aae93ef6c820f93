"""Ending the processes a test started, by pid, with everything they started in turn (a peer's
DHT process and p2p daemon)."""

import psutil

from swarm.cli.launcher import exits_by_itself


def kill_tree(pid: int) -> None:
    """SIGKILL process `pid` and its descendants, and wait (up to 15 s) until they are gone; torch's
    shared-memory manager is left to exit by itself, as the launcher leaves it (killed, it would leave
    the shared memory it tracks in /dev/shm)."""
    tree = psutil.Process(pid)
    victims = [tree, *(p for p in tree.children(recursive=True) if not exits_by_itself(p))]
    for p in victims:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=15)


def kill_started(swarm) -> None:
    """Kill every process of a LocalSwarm that still runs (only the ones this test started)."""
    for proc in swarm.procs:
        if proc.popen.poll() is None:
            kill_tree(proc.popen.pid)
