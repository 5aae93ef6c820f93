"""What the dashboard shows, as data. `SwarmView` folds each look at the swarm (a `Reading`: the
membership records and the newest version announcement) and the records of run directories on
this machine into the one JSON document the page polls (`document()`):

- peers: each member's row (role, peer id, model, version, lag behind the newest announced
  version, rollouts/s over the last minute, tokens/s, how it is reached, its last fetch), and the
  peers that left lately;
- steps: the learner's curves over steps (from its steps.jsonl), thinned to MAX_POINTS;
- observed: the learner's version and groups used over time, as its records say (with no run
  directory, the curves there are);
- lag: per sampler over time, how many versions it was behind the newest announced one: from its
  records as the dashboard sees them, and from its own `progress` events where its run directory
  is given;
- propagation: for each recent version, how many seconds after it was announced each peer held it
  and used it (records as seen, or the samplers' `version_fetched` / `version_used` events).

Every string in it that a peer wrote (peer ids, models, software versions, fetch sources) is data:
the page puts it in the document as text, never as markup.
"""

from __future__ import annotations

import json
import math
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

HISTORY_S = 6 * 3600.0  # observations older than this are forgotten
RATE_WINDOW_S = 60.0  # rollouts/s is measured over this window of a peer's heartbeats
MAX_POINTS = 1000  # points per curve sent to the page (longer runs are thinned, last step kept)
KEEP_STEPS = 8 * MAX_POINTS  # steps kept in memory (thinned to half when there are more)
MAX_VERSIONS = 24  # versions whose propagation is shown (the newest)
HEAT_COLUMNS = 60  # time buckets of the lag heat-map
DEPARTED_KEEP_S = 900.0  # a peer that left is listed as gone for this long


@dataclass
class Reading:
    """One look at the swarm."""

    time: float  # this machine's clock when read (seconds since the epoch)
    swarm_time: float  # the clock the records are stamped with (seconds)
    peers: list[dict]  # rows as `swarm status --json` prints them, plus each record's model and relay
    announcement: dict | None = None  # newest announced version: version, hash, peer_id, sampling


def announcement_fields(announced) -> dict | None:
    """The page's view of a `swarm.fabric.weights.announcements.Announced` (None: nothing announced)."""
    if announced is None:
        return None
    sampling = announced.sampling
    return {"version": int(announced.version), "hash": str(announced.hash), "peer_id": str(announced.peer_id),
            "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens, "lora_r": sampling.lora_r, "base_hash": sampling.base_hash}


def how_reached(row: dict, transport: str) -> dict:
    """Where a peer is reached and how, as far as its record tells: a gRPC peer's id carries the
    address it serves on; a libp2p peer is dialled by its peer id through the DHT, and says in its
    record whether others can dial it (a sampler behind a NAT only dials out)."""
    peer_id = row["peer_id"]
    if transport == "grpc":
        address = peer_id.partition("@")[2] or None
        how = "gRPC server"
    else:
        address = None
        how = "libp2p (peer id via the DHT)"
    if row["role"] == "sampler":
        how += ", dialable: relays versions" if row.get("relay") else ", dials out only (behind a NAT or client mode)"
    elif row.get("holds"):
        how += ", serves versions"
    return {"address": address, "how": how}


@dataclass
class VersionTrail:
    """When a version was announced and when each peer was first seen holding and using it."""

    announced_at: float | None = None
    held: dict[str, float] = field(default_factory=dict)
    used: dict[str, float] = field(default_factory=dict)

    def hold(self, peer: str, at: float) -> None:
        self.held[peer] = min(at, self.held.get(peer, at))

    def use(self, peer: str, at: float) -> None:
        self.used[peer] = min(at, self.used.get(peer, at))

    def announce(self, at: float) -> None:
        self.announced_at = at if self.announced_at is None else min(at, self.announced_at)


class StepSeries:
    """The learner's steps.jsonl as columns: `step` and, per numeric metric, its values (None where a
    step has none); a dict-valued metric (groups dropped or refused by reason, the staleness
    histogram) becomes one column per key, `name/key`; a list (banned peers) its length."""

    def __init__(self) -> None:
        self.count = 0  # steps read (more than are kept, past KEEP_STEPS)
        self.step: list[float] = []
        self.time: list[float] = []
        self.columns: dict[str, list[float | None]] = {}

    def add(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not _number(step):
            return
        values: dict[str, float | None] = {}
        for key, value in record.items():
            if key in ("step", "time"):
                continue
            if isinstance(value, dict):
                values.update({f"{key}/{k}": _finite(v) for k, v in value.items() if _number(v)})
            elif isinstance(value, list):
                values[key] = float(len(value))
            elif _number(value):
                values[key] = _finite(value)
        n = len(self.step)
        for key in values:  # in the record's order (the staleness histogram's buckets, youngest first)
            if key not in self.columns:
                self.columns[key] = [None] * n
        for key, column in self.columns.items():
            column.append(values.get(key))
        self.step.append(float(step))
        self.time.append(float(record["time"]) if _number(record.get("time")) else math.nan)
        self.count += 1
        if len(self.step) > KEEP_STEPS:  # a long run: every other step of it kept, the newest always
            keep = _thin(len(self.step), KEEP_STEPS // 2)
            self.step, self.time = [self.step[i] for i in keep], [self.time[i] for i in keep]
            self.columns = {key: [column[i] for i in keep] for key, column in self.columns.items()}

    def document(self) -> dict | None:
        if not self.step:
            return None
        keep = _thin(len(self.step), MAX_POINTS)
        return {"count": self.count, "step": [self.step[i] for i in keep],
                "series": [{"name": key, "values": [column[i] for i in keep]} for key, column in self.columns.items()]}


class SwarmView:
    """Everything the dashboard has seen of one run. Thread-safe: a poller thread calls `observe`,
    `failed` and the `*_records` methods; the web server's threads call `document()`."""

    def __init__(self, *, run_id: str, transport: str, peers: list[str], poll_s: float, announcements_from: str) -> None:
        self.meta = {"run_id": run_id, "transport": transport, "joined_through": list(peers), "poll_s": poll_s,
                     "announcements_from": announcements_from}
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self.polls = 0
        self.error: str | None = None
        self.error_since: float | None = None
        self.reading: Reading | None = None
        self.newest: int | None = None  # newest version announced (or held by a learner)
        self.first_newest: int | None = None  # ... at the first reading: older versions are not timed
        self.first_seen: dict[str, float] = {}
        self.last_seen: dict[str, tuple[float, str]] = {}  # peer -> (when, role)
        self.baseline: dict[str, set[int]] = {}  # versions a peer already held when first seen
        self.beats: dict[str, deque] = defaultdict(deque)  # peer -> (heartbeat time, rollouts counter)
        self.lag: dict[str, deque] = defaultdict(deque)  # sampler -> (time, versions behind the newest)
        self.trails: dict[int, VersionTrail] = defaultdict(VersionTrail)
        self.observed: deque = deque()  # (time, learner version, learner's groups used, members)
        self.steps = StepSeries()
        self.run_dirs: list[dict] = []  # {name, role, peer_id} of the run directories given
        self._changed = 0  # bumped by every update: the cached document is rebuilt when it moved
        self._cached: tuple[int, bytes] | None = None

    # --- what the poller feeds in

    def observe(self, reading: Reading) -> None:
        with self._lock:
            self._changed += 1
            self.polls += 1
            self.error = self.error_since = None
            self.reading = reading
            rows = reading.peers
            learners = [r for r in rows if r["role"] == "learner"]
            newest = reading.announcement["version"] if reading.announcement else None
            if newest is None and learners:
                newest = max(r["version"] for r in learners)
            if newest is not None:
                if self.first_newest is None:
                    self.first_newest = newest
                else:  # versions announced since the last reading (a record may claim any version: bounded)
                    since = max(self.newest if self.newest is not None else newest, self.first_newest, newest - MAX_VERSIONS)
                    for v in range(since + 1, newest + 1):
                        self.trails[v].announce(reading.time)
                self.newest = newest
            for row in rows:
                self._observe_peer(row, reading)
            if learners:
                lead = max(learners, key=lambda r: r["version"])
                self.observed.append((reading.time, lead["version"], lead["rollouts"], len(rows)))
            self._forget(reading.time)

    def _observe_peer(self, row: dict, reading: Reading) -> None:
        peer, version = row["peer_id"], row["version"]
        held = set(row["holds"]) | {version}
        if peer not in self.first_seen:
            self.first_seen[peer] = reading.time
            self.baseline[peer] = held
        self.last_seen[peer] = (reading.time, row["role"])
        beats = self.beats[peer]
        beat_time = reading.swarm_time - row["last_heartbeat_s"]
        if not beats or abs(beats[-1][0] - beat_time) > 0.05:
            beats.append((beat_time, row["rollouts"]))
        while len(beats) > 2 and beats[-1][0] - beats[1][0] >= RATE_WINDOW_S:
            beats.popleft()
        if row["role"] == "sampler" and self.newest is not None:
            self.lag[peer].append((reading.time, self.newest - version))
        for v in held - self.baseline[peer]:
            self.trails[v].hold(peer, reading.time)
        if version not in self.baseline[peer]:
            self.trails[version].use(peer, reading.time)

    def failed(self, error: str, at: float) -> None:
        """The swarm could not be read this time (what the page shows until a reading succeeds)."""
        with self._lock:
            self._changed += 1
            if self.error_since is None:
                self.error_since = at
            self.error = error

    def step_records(self, records: list[dict], *, restarted: bool = False) -> None:
        """Records of the learner's steps.jsonl (all of it again after `restarted`)."""
        with self._lock:
            self._changed += 1
            if restarted:
                self.steps = StepSeries()
            for record in records:
                self.steps.add(record)
                if _number(record.get("version")) and _number(record.get("time")):
                    self.trails[int(record["version"])].announce(float(record["time"]))  # published as it stepped

    def sampler_events(self, peer: str, records: list[dict]) -> None:
        """Records of a sampler's events.jsonl: when it fetched and used each version, how far behind."""
        with self._lock:
            self._changed += 1
            lags = []
            for e in records:
                at, kind = e.get("time"), e.get("event")
                if not _number(at):
                    continue
                if kind == "version_fetched" and _number(e.get("version")):
                    self.trails[int(e["version"])].hold(peer, float(at))
                elif kind == "version_used" and _number(e.get("version")):
                    self.trails[int(e["version"])].use(peer, float(at))
                    self.trails[int(e["version"])].hold(peer, float(at))
                elif kind == "progress" and _number(e.get("behind")):
                    lags.append((float(at), e["behind"]))
            if lags:
                _merge_sorted(self.lag[peer], lags)

    def set_run_dirs(self, found: list[dict]) -> None:
        with self._lock:
            self._changed += int(found != self.run_dirs)
            self.run_dirs = found

    def _forget(self, now: float) -> None:
        horizon = now - HISTORY_S
        for samples in (*self.lag.values(), self.observed):
            while samples and samples[0][0] < horizon:
                samples.popleft()
        for peer in [p for p, (at, _) in self.last_seen.items() if at < horizon]:
            for table in (self.last_seen, self.first_seen, self.baseline, self.beats, self.lag):
                table.pop(peer, None)
        # a peer may list versions from the future in its record: those far ahead are dropped at once
        kept = [v for v in self.trails if self.newest is None or v <= self.newest + 4 * MAX_VERSIONS]
        for v in set(self.trails) - set(sorted(kept)[-4 * MAX_VERSIONS:]):
            del self.trails[v]

    # --- what the page reads

    def document(self) -> bytes:
        """The page's state as JSON bytes (non-finite numbers become null: JSON has none), made once
        per change however many pages poll it."""
        with self._lock:
            if self._cached is None or self._cached[0] != self._changed:
                state = self._state()
                self._cached = (self._changed, json.dumps(_clean(state), allow_nan=False, separators=(",", ":")).encode())
            return self._cached[1]

    def _state(self) -> dict:
        reading = self.reading
        now = reading.time if reading else None
        peers = [self._peer_row(row, reading) for row in reading.peers] if reading else []
        present = {row["peer_id"] for row in peers}
        departed = [{"peer_id": p, "role": role, "last_seen": at} for p, (at, role) in sorted(self.last_seen.items())
                    if p not in present and now is not None and now - at < DEPARTED_KEEP_S]
        by_peer = {d["peer_id"]: d["name"] for d in self.run_dirs if d.get("peer_id")}
        for row in peers:
            row["run_dir"] = by_peer.get(row["peer_id"])
        return {**self.meta, "now": now, "polls": self.polls, "error": self.error, "error_since": self.error_since,
                "announcement": reading.announcement if reading else None, "newest_version": self.newest,
                "peers": peers, "departed": departed, "run_dirs": self.run_dirs, "steps": self.steps.document(),
                "observed": self._observed(), "lag": self._lag_map(now), "propagation": self._propagation(peers, departed)}

    def _peer_row(self, row: dict, reading: Reading) -> dict:
        peer = row["peer_id"]
        beats = self.beats.get(peer) or ()
        rate = None
        if len(beats) >= 2 and beats[-1][0] > beats[0][0]:
            rate = (beats[-1][1] - beats[0][1]) / (beats[-1][0] - beats[0][0])
        return {**row, "lag": None if self.newest is None else self.newest - row["version"], "rollouts_per_s": rate,
                "reached": how_reached(row, self.meta["transport"]), "first_seen": self.first_seen.get(peer)}

    def _observed(self) -> dict | None:
        if not self.observed:
            return None
        keep = _thin(len(self.observed), MAX_POINTS)
        rows = [self.observed[i] for i in keep]
        return {"time": [r[0] for r in rows], "learner_version": [r[1] for r in rows], "groups_used": [r[2] for r in rows],
                "members": [r[3] for r in rows]}

    def _lag_map(self, now: float | None) -> dict | None:
        samples = {peer: s for peer, s in self.lag.items() if s}
        if not samples or now is None:
            return None
        start = min(s[0][0] for s in samples.values())
        bucket = max((now - start) / HEAT_COLUMNS, self.poll_s, 1.0)
        columns = min(HEAT_COLUMNS, int((now - start) // bucket) + 1)
        rows = []
        for peer, series in sorted(samples.items()):
            cells: list[int | None] = [None] * columns
            for at, lag in series:
                i = min(int((at - start) // bucket), columns - 1)
                cells[i] = lag if cells[i] is None else max(cells[i], lag)
            rows.append({"peer_id": peer, "cells": cells})
        top = max((c for r in rows for c in r["cells"] if c is not None), default=0)
        return {"start": start, "bucket_s": bucket, "columns": columns, "max": top, "rows": rows}

    def _propagation(self, peers: list[dict], departed: list[dict]) -> dict | None:
        versions = sorted((v for v, t in self.trails.items() if (t.announced_at is not None or t.held or t.used)
                           and (self.newest is None or v <= self.newest)), reverse=True)[:MAX_VERSIONS]
        if not versions:
            return None
        # samplers only: a learner holds each version as it announces it
        shown = [p["peer_id"] for p in [*peers, *departed, *self.run_dirs] if p.get("role") == "sampler" and p.get("peer_id")]
        shown = list(dict.fromkeys(shown))
        seen = {peer for v in versions for peer in (*self.trails[v].held, *self.trails[v].used)}
        columns = [p for p in shown if p in seen]
        rows = []
        for v in versions:
            trail = self.trails[v]
            t0 = trail.announced_at
            cells = []
            for peer in columns:
                held, used = trail.held.get(peer), trail.used.get(peer)
                cells.append({"held_s": None if held is None or t0 is None else held - t0,
                              "used_s": None if used is None or t0 is None else used - t0,
                              "held": held is not None, "used": used is not None,
                              "before": held is None and v in self.baseline.get(peer, ())})
            rows.append({"version": v, "announced_at": t0, "cells": cells})
        return {"peers": columns, "versions": rows}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value) -> float | None:
    return float(value) if math.isfinite(value) else None


def _thin(n: int, most: int) -> list[int]:
    """At most `most` indices of 0..n-1, evenly spread, the last one always kept."""
    if n <= most:
        return list(range(n))
    stride = n / most
    keep = sorted({int(i * stride) for i in range(most - 1)} | {n - 1})
    return keep


def _merge_sorted(samples: deque, items: list[tuple]) -> None:
    """Add (time, value) `items` to `samples`, keeping them in time order."""
    items.sort(key=lambda s: s[0])
    if samples and samples[-1][0] > items[0][0]:
        items = sorted([*samples, *items], key=lambda s: s[0])
        samples.clear()
    samples.extend(items)


def _clean(value):
    """JSON-ready: non-finite floats become None (steps.jsonl has NaN where a metric had no data)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value
