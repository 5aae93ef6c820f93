"""Why is nothing happening? The flags `swarm status` prints under its table, computed from the
membership records (swarm.fabric.membership.records) and the newest version announcement alone: one pure
function, `status_flags`, so each flag is tested on records made by hand.

Each flag is {"kind", "peer", "message", "command"}: what looks wrong, about which peer ("" for
the swarm as a whole), in words, and the one command line that shows more. RUN_DIR in a command
is that peer's run directory (`--run-dir`), on its machine. Records are peers' own claims: a flag
says what a record says, never more.

Kinds: `no_learner`, `no_sampler`, `late_heartbeat`, `refused` (a sampler whose groups the
learner keeps refusing, and why), `learner_stalled` (no step for many times its usual step time),
`version_not_picked_up` (versions no sampler holds, long after they were published).
"""

from __future__ import annotations

import shlex
from typing import Sequence

from swarm.config import SwarmSettings, default_of

# A record lives EXPIRY_HEARTBEATS (3) heartbeats: one later than 2 has missed a beat and is about
# to vanish (one beat of slack for the DHT's propagation and a busy peer's scheduling).
LATE_HEARTBEATS = 2.0
# The heartbeat interval of a peer whose record does not say (peers older than that field).
DEFAULT_HEARTBEAT_S = default_of(SwarmSettings, "heartbeat_s")
# A sampler whose last this many groups were all refused has every round refused (a round is 8
# prompts by default), not one unlucky group: a busy learner's backpressure refuses a few at times.
REFUSED_IN_A_ROW = 8
# A learner stalls when it has not stepped for this many times its usual (median) step time, and
# for at least STALL_MIN_S: step times vary (a slow round of rollouts, a checkpoint), and the
# embedded policy steps every second or so, when a pause of a few seconds is nothing.
STALL_FACTOR = 5.0
STALL_MIN_S = 30.0
# A version is overdue when no sampler holds it this long after it was published: samplers look
# for new versions every second and a delta of the embedded policy arrives in well under a second;
# the first snapshot of a large model can take longer (the flag says so).
PICKUP_S = 60.0

# What each refusal kind (records.REFUSALS) means, for the message.
REFUSAL_MEANING = {
    "stale": "its versions are more than the learner's --max-staleness steps old: it does not keep up with new ones",
    "future": "its version is newer than the learner's (a learner restarted from an older checkpoint?)",
    "busy": "the learner's queue is full: more rollouts arrive than it trains on",
    "leaving": "the learner is shutting down",
    "banned": "the learner banned it after repeated bad rollouts",
    "duplicate": "it sent groups the learner already had",
    "malformed": "the learner could not take its groups (another model, vocabulary or software version?)",
    "streams": "it has too many rollout streams open at the learner",
    "unreachable": "it cannot reach the learner",
    "other": "the learner said why in the sampler's events.jsonl",
}


def swarm_args(peers: Sequence[str], run_id: str, transport: str) -> str:
    """The options that point a command at this swarm: `--peers A --peers B --run-id R`
    (`--transport` when not the default), quoted for a shell."""
    words = [w for peer in peers for w in ("--peers", peer)] + ["--run-id", run_id]
    if transport != default_of(SwarmSettings, "transport"):
        words += ["--transport", transport]
    return " ".join(shlex.quote(w) for w in words)


def _flag(kind: str, peer: str, message: str, command: str) -> dict:
    return {"kind": kind, "peer": peer, "message": message, "command": command}


def _picked_up(record) -> int:
    """The newest version a sampler's record says it has: uses, holds or last fetched."""
    return max([record.version, record.fetch_version, *record.holds])


def status_flags(now: float, members: Sequence, announced_version: int | None = None, *, args: str = "--peers ADDR") -> list[dict]:
    """What looks wrong in the swarm at `now` (the swarm's clock), from `members` (records.Member:
    anything with a `.record`) and the newest announced version (None: the newest a learner's
    record holds). `args` points the commands at the swarm (`swarm_args`). Empty when nothing does."""
    status = f"swarm status {args}"
    records = [m.record for m in members]
    learners = [r for r in records if r.role == "learner"]
    samplers = [r for r in records if r.role == "sampler"]
    flags = []
    if not learners:
        flags.append(_flag("no_learner", "", "no learner in this run: samplers have nothing to fetch or send to "
                           "(start `swarm learner` with the same --peers and --run-id, or check --run-id)",
                           f"{status} --watch 5"))
    if not samplers:
        flags.append(_flag("no_sampler", "", "no sampler in this run: the learner gets no rollouts (start `swarm sampler` "
                           "with the same --peers and --run-id and the learner's --learner-key)", f"{status} --watch 5"))
    for r in records:
        beat_s = r.heartbeat_s or DEFAULT_HEARTBEAT_S
        age = now - r.time
        if age > LATE_HEARTBEATS * beat_s:
            flags.append(_flag("late_heartbeat", r.peer_id,
                               f"{r.role} {r.peer_id} was last heard {age:.0f} s ago (it heartbeats every {beat_s:g} s): "
                               "stopped, stuck or cut off from the swarm (or its clock is off)",
                               f"{status} --watch {max(beat_s, 1.0):g}"))
    for r in samplers:
        if r.refused_in_a_row >= REFUSED_IN_A_ROW:
            kind = r.refusal or "other"
            flags.append(_flag("refused", r.peer_id,
                               f"sampler {r.peer_id}: the learner refused its last {r.refused_in_a_row} groups "
                               f"({r.refused} in all), the last as {kind}: {REFUSAL_MEANING.get(kind, kind)}",
                               "grep '\"event\": \"sent\"' RUN_DIR/events.jsonl | tail -n 5"))
    # the learner that is furthest along speaks for the run (several learners step together)
    learner = max(learners, key=lambda r: (r.version, r.time), default=None)
    if learner is not None and learner.heartbeat_s > 0:  # older learners do not say when they stepped
        idle = learner.since_step_s + max(0.0, now - learner.time)
        if learner.step_s > 0 and idle > max(STALL_FACTOR * learner.step_s, STALL_MIN_S):
            flags.append(_flag("learner_stalled", learner.peer_id,
                               f"learner {learner.peer_id} has not stepped for {idle:.0f} s, {idle / learner.step_s:.0f} "
                               f"times its usual {learner.step_s:.1f} s per step (at version {learner.version}): "
                               "no rollouts reach it, it refuses them, or it is stuck in a step",
                               "tail -n 20 RUN_DIR/events.jsonl"))
        elif learner.step_s == 0 and idle > STALL_MIN_S:
            flags.append(_flag("learner_stalled", learner.peer_id,
                               f"learner {learner.peer_id} has taken no step in the {idle:.0f} s since it started (at "
                               f"version {learner.version}): no rollouts have reached it yet",
                               "tail -n 20 RUN_DIR/events.jsonl"))
        newest = max(announced_version if announced_version is not None else learner.version, learner.version)
        held = max((_picked_up(r) for r in samplers), default=None)
        if held is not None and held < newest and learner.version == newest:
            # when the oldest version nobody holds was published: the newest's publication (its
            # record says how long ago it stepped) less a usual step per version since
            waiting = idle + (newest - held - 1) * learner.step_s
            if waiting > PICKUP_S:
                count = newest - held
                which = f"version {newest}" if count == 1 else f"versions {held + 1}..{newest}"
                flags.append(_flag("version_not_picked_up", learner.peer_id,
                                   f"{which} of learner {learner.peer_id} {'is' if count == 1 else 'are'} held by no "
                                   f"sampler, the oldest published about {waiting:.0f} s ago (samplers have at most "
                                   f"version {held}): they cannot fetch from the learner or its relays (a first snapshot "
                                   "of a large model can take longer)", f"swarm dashboard {args}"))
    return flags
