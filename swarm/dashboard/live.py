"""The dashboard over a live swarm: what `swarm status`, `swarm dashboard` and a peer started with
`--dashboard-port` share.

- `status_rows`: the rows `swarm status` prints, from the membership records (staleness from the announced version);
- `read_swarm`: one look through any fabric (an observer, or a peer's own): those rows plus each
  record's model and relay, and the newest version announcement;
- `LiveDashboard`: the view, its poller and its web server together, over a fabric. `swarm
  dashboard` runs one over an observer; a learner or sampler runs one over its own fabric (from the
  poller's thread: fabrics take calls from several threads, as the heartbeat thread already does),
  a bootstrap node over an observer joined through itself.
"""

from __future__ import annotations

import errno
import time
from pathlib import Path
from typing import Iterable, Sequence

from swarm.dashboard.poller import Poller
from swarm.dashboard.runs import RunDirs
from swarm.dashboard.server import DashboardServer
from swarm.dashboard.state import Reading, SwarmView, announcement_fields
from swarm.ports import PortTaken

NO_KEY = "none: no learner key given, so no version is shown (any peer can call itself a learner; pass --learner-key)"


def status_rows(now: float, members: list, learner_version: int | None = None) -> tuple[int | None, list[dict]]:
    """The learner's version and one row per member, as `swarm status --json` prints them, each
    row's staleness counted from `learner_version`: the version announced under the run's keys
    (the caller reads it), never one a membership record claims, which any peer can write. Every
    string in a row is the peer's own."""
    rows = [{"role": m.record.role, "peer_id": m.record.peer_id, "version": m.record.version,
             "staleness": None if learner_version is None else learner_version - m.record.version,
             "rollouts": m.record.rollouts, "tokens_per_s": round(m.record.tokens_per_s, 1),
             "last_heartbeat_s": round(now - m.record.time, 1), "software": m.record.software,
             "holds": list(m.record.holds),
             "last_fetch": None if m.record.fetch_version < 0 else {
                 "version": m.record.fetch_version, "source": m.record.fetch_from, "bytes": m.record.fetch_bytes,
                 "seconds": m.record.fetch_s}} for m in members]
    return learner_version, rows


def read_swarm(observer, learner_keys: Sequence[bytes]) -> Reading:
    """One look at the swarm through `observer` (any fabric): every member's row (as `swarm status`
    shows it, plus the model and whether others can dial it) and the newest announcement under
    `learner_keys` (the run's keys, or learners they certified). None given: no announcement, as
    `swarm status` shows no version without --learner-key: a record's role is its writer's word."""
    now = observer.now()
    members = observer.members()
    keys = list(learner_keys)
    announced = observer.latest_announced(keys) if keys else None
    _, rows = status_rows(now, members, announced.version if announced is not None else None)
    for row, member in zip(rows, members):
        row.update(model=member.record.model, relay=member.record.relay)
    return Reading(time=time.time(), swarm_time=now, peers=rows, announcement=announcement_fields(announced))


class LiveDashboard:
    """Serves the dashboard of the swarm `observer` reads (a fabric: `now`, `members`,
    `latest_announced`, `unreachable_errors`) on host:port (0: a free one) until `close()`; a port
    taken or an address not this machine's raises OSError here, before anything runs.

    `learner_keys`: count only these learners' announcements (empty: none, which `announcements_from`
    then tells the page). `run_dirs`: run directories on this
    machine (a peer's own, a demo's), read as they grow. The observer stays the caller's to shut down."""

    def __init__(self, observer, *, run_id: str, transport: str, peers: Iterable[str], host: str, port: int,
                 learner_keys: Sequence[bytes] = (), announcements_from: str | None = None,
                 run_dirs: Sequence[Path] = (), poll_s: float) -> None:
        keys = list(learner_keys)
        self._closed = False
        self.view = SwarmView(run_id=run_id, transport=transport, peers=list(peers), poll_s=poll_s,
                              announcements_from=announcements_from or ("the learner key(s) given" if keys else NO_KEY))
        self.server = DashboardServer(self.view, host=host, port=port)
        try:
            self.poller = Poller(self.view, lambda: read_swarm(observer, keys),
                                 run_dirs=RunDirs(list(run_dirs)) if run_dirs else None, interval_s=poll_s,
                                 failures=(*observer.unreachable_errors(), TimeoutError))
        except BaseException:
            self.server.close()
            raise

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def port(self) -> int:
        return self.server.port

    def close(self) -> None:
        """Stop reading and serving (idempotent). Before the observer is shut down: the poller reads it."""
        if self._closed:
            return
        self._closed = True
        self.poller.close()
        self.server.close()


def peer_dashboard(config, observer, *, run_dir: Path, learner_keys: Sequence[bytes] = (),
                   announcements_from: str | None = None, peers: Sequence[str] | None = None) -> LiveDashboard | None:
    """The dashboard a peer serves itself when its config (learner, sampler or bootstrap: its
    `dashboard_*` settings, run id and transport) sets `dashboard_port`, else None: the swarm as
    `observer` reads it, and the peer's own run directory. `peers`: where it joined (default: the
    config's)."""
    if config.dashboard_port is None:
        return None
    try:
        return LiveDashboard(observer, run_id=config.run_id, transport=config.transport,
                             peers=config.peers if peers is None else peers, host=config.dashboard_host,
                             port=config.dashboard_port, learner_keys=learner_keys, announcements_from=announcements_from,
                             run_dirs=[Path(run_dir)], poll_s=config.dashboard_poll_s)
    except OSError as exc:  # taken since the command checked it: said as that check says it
        if exc.errno == errno.EADDRINUSE:
            raise PortTaken("--dashboard-port", config.dashboard_host, config.dashboard_port) from None
        raise
