"""A learner's announcement pushed straight to the peers it names as its delta's sharers.

A sampler learns of a new version at its next look at the announcements (a DHT or registry read,
every poll), or when a sampler that started on it already asks it for its stripe
(VersionFollower.nudge). In traced 8-sampler fan-outs over hivemind (100 Mbit/s, a 9.7 MB delta)
the last sampler began 0.28-0.65 s after the announcement, a third of the whole fan-out, and
while samplers trickle in, stripes reach their owners late. So when a learner announces a version
it also sends the announcement to each peer it names as a sharer (`AnnouncementPusher`, from
Fabric.announce), over the weight protocol (a request {"op": "announce", ...}), and they start a
round trip after it instead of a poll and a lookup after it.

A pushed announcement is signed as the registry stores one (signing.signed_value: the learner's
`[owner:...]` key, the msgpack payload and its RSA signature), on both transports, and a receiver
trusts it no more than one it looked up: the signature must hold for the key it names, and that
key must be one the follower was given or carry the run owner's certificate
(announcements.newest_authorised). A push that does not verify is refused and changes nothing. One
signed longer ago than an announcement lives in the swarm (plus the clock skew allowed between
peers) is refused too: a former sharer replaying an old push after the learner restarted cannot
send samplers after a version that is gone. A push is only a head start: a sampler's next look at
the announcements corrects whatever it got wrong.

The learner pushes on threads of its own and never lets a push hold up or fail the announcement
itself. A sharer that does not answer is not pushed to again for a while (peers name themselves in
their records, so the named may be unreachable or made up), and a push of a version that a newer
one overtook is not sent at all: a queue of stale pushes cannot build up behind slow sharers.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

from swarm.fabric.signing import MAX_CLOCK_SKEW_S, signed_value, unpacked, verify_owner_signature
from swarm.fabric.weights.announcements import Announced, newest_authorised

logger = logging.getLogger(__name__)


PUSH_OP = "announce"
MAX_PUSH_BYTES = 48 * 1024  # an announcement: 64 sharers' ids, recent hashes, a certificate, a key and signature
PUSH_WORKERS = 8  # pushes under way at once (each is one small request and its answer)
PUSH_TIMEOUT_S = 10.0  # a sharer that does not answer by then learns of the version at its next poll
MAX_PENDING_PUSHES = 8  # pushes a sampler checks one by one; beyond, it answers busy (a flood costs a queue, not cores)
PUSH_BACKOFF_S = 60.0  # a sharer that did not answer a push is not pushed to again for this long
REMEMBERED_PUSHES = 4  # versions whose push is remembered as done (an announcement repeats at every heartbeat)
# how old a pushed announcement may be: as long as one lives in the DHT or the registry
# (announcements.store_announcement's expiry), plus the skew allowed between peers' clocks
MAX_PUSH_AGE_S = 60.0 + MAX_CLOCK_SKEW_S


def push_request(signing_key, announcement) -> dict:
    """The push of `announcement` (a VersionAnnouncement), signed with `signing_key`."""
    return {"op": PUSH_OP, **signed_value(signing_key, announcement.dict())}


def read_push(request: dict, learner_keys: Iterable[bytes], run_id: str, now: float | None = None) -> Announced | None:
    """The Announced a push carries when its signature holds, its key may publish `run_id`'s
    versions (as for a looked-up announcement) and it was signed within MAX_PUSH_AGE_S of `now`
    (this peer's clock), else None. A key other than `learner_keys` is honoured only with a
    certificate in the payload, and only that case unpacks the payload before its signature is
    checked: a stranger's flood costs no signature checks."""
    learner_keys = list(learner_keys)
    fields = [request.get(name) for name in ("owner", "payload", "signature")]
    if not all(isinstance(f, bytes) for f in fields) or sum(map(len, fields)) > MAX_PUSH_BYTES:
        return None
    owner, payload, signature = fields
    value = None
    if owner not in learner_keys:
        value = unpacked(payload)
        if not isinstance(value, dict) or not value.get("certificate"):
            return None
    if not verify_owner_signature(owner, payload, signature):
        return None
    value = value if value is not None else unpacked(payload)
    signed = value.get("time") if isinstance(value, dict) else None
    now = time.time() if now is None else now
    if not isinstance(signed, float) or not now - MAX_PUSH_AGE_S <= signed <= now + MAX_CLOCK_SKEW_S:
        return None
    return newest_authorised([(owner, value)], learner_keys, run_id)


def answer_push(hear: Callable[[dict], bool] | None, request: dict) -> dict:
    """A weight server's answer to a push: `hear` (the follower's, VersionFollower.pushed) takes
    it; None when this peer follows no learner."""
    if hear is None:
        return {"ok": False, "reason": "this peer follows no learner's announcements", "count": 0}
    try:
        taken = hear(request)
    except Exception as exc:  # noqa: BLE001  whatever a pusher sent, it gets an answer
        logger.debug("a pushed announcement failed: %s", exc)
        taken = False
    return {"ok": True, "count": 0} if taken else {"ok": False, "reason": "the announcement does not verify", "count": 0}


class AnnouncementPusher:
    """Sends each version's announcement to the peers it names as sharers, once per version (an
    announcement repeats at every heartbeat), on threads of its own. `signing_key`: the learner's;
    `client`: makes the weight client to push with (its `tell(peer, request, timeout)` returns the
    peer's answer), on a push thread when the first push goes out."""

    def __init__(self, signing_key, client: Callable[[], object]) -> None:
        self.signing_key, self._make_client, self._client = signing_key, client, None
        self._pool = ThreadPoolExecutor(PUSH_WORKERS, thread_name_prefix="announce-push")
        self._pushed: list[int] = []
        self._lock = threading.Lock()
        self._silent: dict[str, float] = {}  # sharer -> until when it is not pushed to (it did not answer)
        self.sent = self.answered = self.taken = 0  # pushes sent, answered, and taken by their receiver

    def push(self, announcement) -> None:
        """Push `announcement` (a VersionAnnouncement) to its sharers, unless its version went out
        already. Never raises: the announcement it rides with must go out all the same."""
        try:
            if not announcement.sharers or announcement.version in self._pushed:
                return
            self._pushed = (self._pushed + [announcement.version])[-REMEMBERED_PUSHES:]
            request = push_request(self.signing_key, announcement)
            now = time.monotonic()
            for peer in announcement.sharers:
                if self._silent.get(peer, 0.0) <= now:
                    self._pool.submit(self._tell, peer, request, announcement.version)
        except Exception as exc:  # noqa: BLE001  (a pool shut down by a closing fabric, say)
            logger.debug("pushing version %d failed: %s", announcement.version, exc)

    def _tell(self, peer: str, request: dict, version: int) -> None:
        if self._pushed and version < self._pushed[-1]:
            return  # a newer version's push is on its way to this peer
        try:
            with self._lock:
                if self._client is None:
                    self._client = self._make_client()
            answer = self._client.tell(peer, request, PUSH_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001  the peer hears of the version at its next poll
            logger.debug("pushing an announcement to %s failed: %s: %s", peer, type(exc).__name__, exc)
            answer = None
        taken = isinstance(answer, dict) and bool(answer.get("ok"))
        if answer is not None and not taken:
            logger.debug("%s did not take the pushed announcement: %s", peer, answer)
        with self._lock:
            self.sent += 1
            self.answered += answer is not None
            self.taken += taken
            if answer is None:
                self._silent[peer] = time.monotonic() + PUSH_BACKOFF_S
                for gone in [p for p, until in self._silent.items() if until <= time.monotonic()]:
                    del self._silent[gone]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
