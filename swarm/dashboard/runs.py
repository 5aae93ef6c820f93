"""Run directories on this machine, read as they grow: the learner's `steps.jsonl` and the peers'
`events.jsonl` (swarm.runlog describes both). The dashboard is given a peer's run directory, or a
directory of them (a demo's `runs/demo-*/`), and reads only the records written since its last
look, so a long run costs nothing per poll."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.runlog import EVENTS_FILE, STEPS_FILE, read_ready

MAX_READ_BYTES = 16 << 20  # read at most this much of a file per poll (a huge backlog is read over several)


class JsonlTail:
    """The records appended to a JSONL file since the last `read()`. A line still being written is
    left for the next read; a line that does not parse is skipped; a file replaced or cut shorter
    (a run directory reused) is read again from its start, and `restarted` says so."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.offset = 0
        self.inode: int | None = None
        self.restarted = False

    def read(self) -> list[dict[str, Any]]:
        self.restarted = False
        try:
            stat = os.stat(self.path)
        except OSError:
            return []
        if self.inode is not None and (stat.st_ino != self.inode or stat.st_size < self.offset):
            self.offset, self.restarted = 0, True
        self.inode = stat.st_ino
        if stat.st_size <= self.offset:
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read(min(stat.st_size - self.offset, MAX_READ_BYTES))
        whole = chunk[:chunk.rfind(b"\n") + 1]  # up to the last complete line
        self.offset += len(whole)
        records = []
        for line in whole.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # cut short by a kill
            if isinstance(record, dict):
                records.append(record)
        return records


@dataclass
class PeerRunDir:
    """One peer's run directory: its role and peer id once its ready.json exists (an in-process
    trainer's has none: a directory with steps.jsonl is a learner's), and tails of its files."""

    path: Path
    role: str | None = None
    peer_id: str | None = None
    steps: JsonlTail = field(init=False)
    events: JsonlTail = field(init=False)

    def __post_init__(self) -> None:
        self.steps = JsonlTail(self.path / STEPS_FILE)
        self.events = JsonlTail(self.path / EVENTS_FILE)

    @property
    def name(self) -> str:
        return self.path.name

    def identify(self) -> None:
        """Role and peer id from ready.json (again each time: a restarted peer writes a new one)."""
        ready = read_ready(self.path)
        if ready is not None:
            role, peer_id = ready.get("role"), ready.get("peer_id")
            self.role = role if isinstance(role, str) else self.role
            self.peer_id = peer_id if isinstance(peer_id, str) else self.peer_id
        elif self.role is None and (self.path / STEPS_FILE).exists():
            self.role = "learner"


def is_peer_dir(path: Path) -> bool:
    return any((path / name).exists() for name in ("ready.json", STEPS_FILE, EVENTS_FILE))


class RunDirs:
    """The run directories the dashboard was given, each either a peer's or a directory of peers'
    (looked into one level deep, again at every poll: peers started later are found)."""

    def __init__(self, paths: list[Path]) -> None:
        self.roots = [Path(p) for p in paths]
        self.peers: dict[Path, PeerRunDir] = {}

    def scan(self) -> list[PeerRunDir]:
        for root in self.roots:
            candidates = [root] if is_peer_dir(root) else sorted(p for p in _subdirs(root) if is_peer_dir(p))
            for path in candidates:
                if path not in self.peers:
                    self.peers[path] = PeerRunDir(path)
        for peer in self.peers.values():
            peer.identify()
        return list(self.peers.values())


def _subdirs(root: Path) -> list[Path]:
    try:
        return [p for p in root.iterdir() if p.is_dir()]
    except OSError:
        return []
