"""A learner's rollout inbox, whatever the transport (`InboxCore`; hivemind/rollouts.py and
grpc/rollouts.py feed it frames):
- validates every frame (wire.decode_group) and answers with the reason when it refuses one;
- delivers each group at most once (a bounded memory of recently seen group uids);
- applies backpressure: a bounded queue; when it is full the handler stops reading, so the
  sender's writes block instead of the learner's memory growing, and after `put_timeout_s` the
  group is refused as "busy" (the sampler counts it and moves on);
- shares the queue fairly: while several peers send, each may hold at most its share
  (capacity / active peers) of it, so one fast or hostile sampler cannot crowd out the rest;
- bounds what a peer can hold open (`StreamLimits`): a few streams per peer, a total, an idle
  deadline between frames and a deadline per frame that grows with its size (a slow sender is cut
  off, not waited on);
- counts accepted and refused groups per peer; a peer that keeps sending bad data (malformed
  groups here, forged rewards reported by the learner through `penalise`) is banned for a while
  (bans.py) and everything it sends meanwhile is refused unread. Each kind of garbage is logged
  once per peer, not once per frame.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import re
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from swarm.config import TrainingSettings, default_of
from swarm.fabric.rollouts.bans import PeerBans
from swarm.fabric.rollouts.wire import InvalidRollout, WireLimits, decode_group
from swarm.rollouts import RolloutGroup

logger = logging.getLogger(__name__)


@dataclass
class InboxStats:
    accepted: Counter = field(default_factory=Counter)  # sampler id -> groups accepted
    refused: Counter = field(default_factory=Counter)  # sampler id (or peer id) -> groups refused
    reasons: Counter = field(default_factory=Counter)  # reason -> count
    duplicates: int = 0


def refusal_kind(reason: str) -> str:
    """A refusal's reason with its numbers taken out: the key it is counted and logged under (a
    flood of frames of different sizes is one kind of garbage, not thousands)."""
    return re.sub(r"[0-9][0-9.e+-]*", "#", reason)[:120]


@dataclass(frozen=True)
class StreamLimits:
    """What one learner lets senders hold open. An honest sampler sends one stream at a time."""

    per_peer: int = 4  # open rollout streams per peer
    total: int = 48  # open rollout streams in all (a gRPC server keeps threads free for weight requests)
    idle_s: float = 30.0  # longest wait for the next frame of an open stream
    frame_s: float = 10.0  # a frame's deadline: this, plus its size at `min_bytes_per_s`
    min_bytes_per_s: float = 256 * 1024
    # a stream that only trickles holds a slot others need: past `rate_grace_s` of waiting on the
    # sender, it must have sent `stream_bytes_per_s` on average (gRPC inbox; an honest sampler
    # sends its groups at once)
    rate_grace_s: float = 5.0
    stream_bytes_per_s: float = 1024

    def sender_budget(self, waited_s: float, received: int) -> float:
        """Seconds a stream's sender may still take for its next frame, having kept the learner
        waiting `waited_s` in all and sent `received` bytes."""
        return max(self.rate_grace_s, received / self.stream_bytes_per_s) - waited_s

    def frame_deadline(self, size: int) -> float:
        return self.frame_s + size / self.min_bytes_per_s


class InboxCore:
    """What a learner's inbox does whatever the transport: validate each frame, deliver each group
    at most once into a bounded queue shared fairly between senders, count and ban. `get(timeout)`
    hands groups out, oldest first. Transports feed frames to `accept` (asyncio handlers) or
    `accept_blocking` (threaded servers), and call `open_stream`/`close_stream` around each stream."""

    def __init__(self, *, vocab_size: int, max_staleness: int = default_of(TrainingSettings, "max_staleness"), capacity: int = 256,
                 put_timeout_s: float = 30.0, limits: WireLimits = WireLimits(), remember_uids: int = 100_000,
                 bans: PeerBans | None = None, streams: StreamLimits = StreamLimits()) -> None:
        self.vocab_size, self.max_staleness, self.limits, self.streams = vocab_size, max_staleness, limits, streams
        self.bans = bans or PeerBans()
        self.put_timeout_s, self.capacity = put_timeout_s, capacity
        self.learner_version = 0  # set by the learner as it steps
        self.stats = InboxStats()
        self._queue: queue.Queue[RolloutGroup] = queue.Queue(maxsize=capacity)
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._remember = remember_uids
        self._lock = threading.Lock()
        self._open: Counter = Counter()  # peer -> open streams
        self._queued: Counter = Counter()  # peer -> its groups in the queue
        self._logged: set[tuple[str, str]] = set()  # (peer, kind of refusal) already logged
        self.closed = threading.Event()  # set on close: a put waiting for room gives up at once

    def get(self, timeout: float | None = None) -> RolloutGroup | None:
        try:
            group = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        with self._lock:
            self._queued[group.sender] -= 1
            if self._queued[group.sender] <= 0:
                del self._queued[group.sender]
        return group

    def open_stream(self, peer: str) -> str | None:
        """Count a stream `peer` opens; the reason to refuse it when it would pass a limit."""
        with self._lock:
            if self._open[peer] >= self.streams.per_peer:
                reason = f"more than {self.streams.per_peer} open rollout streams from one peer"
            elif sum(self._open.values()) >= self.streams.total:
                reason = f"the learner has {self.streams.total} rollout streams open; try again later"
            else:
                self._open[peer] += 1
                return None
        self.stats.reasons["too many streams"] += 1
        self.note_refusal(peer, reason)
        return reason

    def close_stream(self, peer: str) -> None:
        with self._lock:
            self._open[peer] -= 1
            if self._open[peer] <= 0:
                del self._open[peer]

    def open_streams(self) -> int:
        """Rollout streams open now, from all peers."""
        with self._lock:
            return sum(self._open.values())

    def share(self) -> int:
        """How many queued groups one peer may hold now: the capacity split between the peers with
        a stream open or a group queued (all of it while one peer sends)."""
        with self._lock:
            active = len(set(self._open) | set(self._queued))
        return max(1, self.capacity // max(1, active))

    def _try_put(self, group: RolloutGroup) -> bool:
        share = self.share()
        with self._lock:
            if self._queued[group.sender] >= share:
                return False
            try:
                self._queue.put_nowait(group)
            except queue.Full:
                return False
            self._queued[group.sender] += 1
            return True

    def note_refusal(self, peer: str, reason: str) -> None:
        """Log a refusal once per peer and kind (numbers stripped), not once per frame: a flood of
        garbage must not become a flood of log lines."""
        key = (peer, refusal_kind(reason))
        with self._lock:
            if key in self._logged:
                first = False
            else:
                if len(self._logged) > 10_000:
                    self._logged.clear()
                self._logged.add(key)
                first = True
        if first:
            logger.warning("refused rollouts from %s: %s (further refusals of this kind from it are not logged)", peer, reason)

    def qsize(self) -> int:
        return self._queue.qsize()

    def _first_time(self, uid: str) -> bool:
        with self._lock:
            if uid in self._seen:
                return False
            self._seen[uid] = None
            while len(self._seen) > self._remember:
                self._seen.popitem(last=False)
            return True

    def penalise(self, peer: str, reason: str, *, ban: bool = False) -> None:
        """Count a group refused for the sender's fault (malformed here, or forged rewards found by
        the learner) against its sender; repeated offences ban it, and `ban` bans it at once."""
        self.stats.refused[peer] += 1
        self.stats.reasons[refusal_kind(reason)] += 1
        if not peer:
            return
        if ban and self.bans.ban_s > 0:
            self.bans.ban(peer)
            logger.warning("banned peer %s for %.0fs: %s", peer, self.bans.ban_s, reason)
        elif self.bans.strike(peer):
            logger.warning("banned peer %s for %.0fs after repeated bad rollouts (last: %s)", peer, self.bans.ban_s, reason)

    def _admit(self, frame: bytes, remote: str):
        """(uid, group) to enqueue, or the ack refusing the frame."""
        left = self.bans.remaining(remote)
        if left > 0:
            self.stats.refused[remote] += 1
            self.stats.reasons["banned"] += 1
            # one reason for every banned frame (a sampler counts refusals by reason), the time apart
            return {"ok": False, "reason": "banned after repeated bad rollouts", "retry_after_s": round(left)}
        try:
            uid, group = decode_group(frame, vocab_size=self.vocab_size, learner_version=self.learner_version,
                                      max_staleness=self.max_staleness, limits=self.limits)
        except InvalidRollout as exc:
            self.note_refusal(remote, str(exc))
            if exc.blame:
                self.penalise(remote, str(exc))
            else:
                self.stats.refused[remote] += 1
                self.stats.reasons["stale or future version"] += 1
            return {"ok": False, "reason": str(exc)}
        except Exception as exc:  # noqa: BLE001  the boundary: no frame ends the inbox, whatever it holds
            reason = f"could not be decoded ({type(exc).__name__})"
            self.note_refusal(remote, f"{reason}: {exc}")
            self.penalise(remote, reason)
            return {"ok": False, "reason": reason}
        group.sender = remote
        if not self._first_time(uid):
            self.stats.duplicates += 1
            return {"ok": False, "reason": "duplicate"}
        return uid, group

    def _delivered(self, uid: str, group: RolloutGroup, ok: bool) -> dict:
        if ok:
            self.stats.accepted[group.sampler_id] += 1
            return {"ok": True}
        with self._lock:
            self._seen.pop(uid, None)  # not delivered: the same group may come again
        reason = "the learner is leaving" if self.closed.is_set() else "busy"
        self.stats.reasons[reason] += 1
        return {"ok": False, "reason": reason}

    async def accept(self, frame: bytes, remote: str) -> dict:
        admitted = self._admit(frame, remote)
        if isinstance(admitted, dict):
            return admitted
        uid, group = admitted
        # While the queue is full, or this peer holds its share of it, this stream (and so the
        # sender) waits: backpressure. Polling, not a blocking put in a thread, so that closing the
        # inbox never waits on a stuck put.
        deadline = time.monotonic() + self.put_timeout_s
        while not self._try_put(group):
            if time.monotonic() > deadline or self.closed.is_set():
                return self._delivered(uid, group, False)
            await asyncio.sleep(0.02)
        return self._delivered(uid, group, True)

    def accept_blocking(self, frame: bytes, remote: str) -> dict:
        """The same, for a server thread: blocks while the queue is full (up to put_timeout_s)."""
        admitted = self._admit(frame, remote)
        if isinstance(admitted, dict):
            return admitted
        uid, group = admitted
        deadline = time.monotonic() + self.put_timeout_s
        while not self._try_put(group):
            if time.monotonic() > deadline or self.closed.is_set():
                return self._delivered(uid, group, False)
            time.sleep(0.02)  # a server thread stops waiting when the inbox closes (the learner is leaving)
        return self._delivered(uid, group, True)
