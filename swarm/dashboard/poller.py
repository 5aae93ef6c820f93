"""The dashboard's one background thread: every `interval_s` it reads the swarm (a `read()` given by
the caller, which holds the observer) and the run directories' new records, and feeds them to the
`SwarmView`. A swarm that cannot be reached for a while is shown on the page and read again at the
next poll; peers coming and going are just what the next reading says."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from swarm.dashboard.runs import RunDirs
from swarm.dashboard.state import Reading, SwarmView

logger = logging.getLogger(__name__)


class Poller:
    """Polls until `close()`. `failures`: what a failed reading raises (a peer or the registry gone
    for a moment): shown on the page, logged (the 1st, 10th and every 100th in a row), tried again.
    Anything else is a bug: the page says the dashboard stopped reading, and the thread ends."""

    def __init__(self, view: SwarmView, read: Callable[[], Reading], *, run_dirs: RunDirs | None = None,
                 interval_s: float = 1.5, failures: tuple[type[BaseException], ...] = (OSError, TimeoutError)) -> None:
        self.view, self.read, self.run_dirs = view, read, run_dirs
        self.interval_s, self.failures = interval_s, failures
        self.failed_in_a_row = 0
        self.learner_path = None  # the run directory whose steps.jsonl the curves show
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dashboard-poller", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.poll()
                self._stop.wait(self.interval_s)
        except BaseException as exc:
            self.view.failed(f"the dashboard stopped reading the swarm: {type(exc).__name__}: {exc} (see its log)", time.time())
            raise

    def poll(self) -> None:
        """One reading of the swarm and of the run directories."""
        try:
            reading = self.read()
        except self.failures as exc:
            self.failed_in_a_row += 1
            if self.failed_in_a_row in (1, 10) or self.failed_in_a_row % 100 == 0:
                logger.warning("could not read the swarm (%d time(s) in a row): %s: %s", self.failed_in_a_row,
                               type(exc).__name__, exc)
            self.view.failed(f"could not read the swarm: {type(exc).__name__}: {exc}", time.time())
        else:
            self.failed_in_a_row = 0
            self.view.observe(reading)
        if self.run_dirs is not None:
            self.read_run_dirs()

    def read_run_dirs(self) -> None:
        found = []
        for peer in self.run_dirs.scan():
            found.append({"name": peer.name, "role": peer.role, "peer_id": peer.peer_id, "path": peer.path})
            if peer.role == "learner" and peer.path == self._learner_dir(found):  # the first learner's curves
                records = peer.steps.read()
                if records or peer.steps.restarted:
                    self.view.step_records(records, restarted=peer.steps.restarted)
            elif peer.role == "sampler" and peer.peer_id is not None:  # events are filed under its peer id
                records = peer.events.read()
                if records:
                    self.view.sampler_events(peer.peer_id, records)
        self.view.set_run_dirs([{k: v for k, v in d.items() if k != "path"} for d in found])

    def _learner_dir(self, found: list[dict]):
        if self.learner_path is None:
            self.learner_path = next((d["path"] for d in found if d["role"] == "learner"), None)
        return self.learner_path

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
