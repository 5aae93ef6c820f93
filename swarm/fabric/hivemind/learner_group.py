"""Several learners training one policy: gradients averaged by hivemind's DecentralizedAverager,
bit-identical weights, state handed to late joiners, and only authorised learners let in.

What hivemind gives: matchmaking over the DHT (whoever is averaging at the moment forms a group),
a butterfly all-reduce (each member reduces a slice of the vector and sends it back), an all-gather
of small metadata in the same round, and state download for a peer that joins late.

What is built around it, and why:
- **Bit-identical results.** hivemind's all-reduce returns each member `local + (average - local)`,
  which float rounding makes differ in the last bits between members; their weights would then
  drift apart. So each member sends its gradient, times its rows, as integers in float64 (fixed
  point at 2^-24, exact while sums stay below 2^53): the average comes back within a few ulps
  everywhere, and `round(average * members)` is then the exact integer sum at every member. Divided
  by the gathered total of rows, the mean gradient is the same bits at every learner, so the same
  clip and AdamW step keep the weights identical (same torch build and device type).
- **Trust.** hivemind's averaging trusts anyone who finds its DHT key: any peer may join a group,
  lead one, send parts or download the state. The averager here serves and averages only with
  libp2p peer ids of learners the run owner certified (swarm.fabric.membership.authority; libp2p authenticates
  peer ids on every connection): join requests, parts and state downloads from others are refused,
  and a group holding an unauthorised member (such as a rogue leader) is left before any tensor is
  sent. An authorised learner is trusted to send honest gradients; a non-finite result is refused.
  What remains open to others is denial of service: a peer that writes the matchmaking key can make
  rounds time out, after which each learner steps alone and they re-synchronise.
- **One version sequence.** Every member gathers each other's version and weight hash with the
  gradients. Members behind or holding other weights than the rest (the canonical state: the newest
  version, the hash most of its holders share, then the lowest peer id) throw the round away and
  download the canonical state (weights, AdamW state and version), verified by hash.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.compression import deserialize_tensor_stream
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture

from swarm.fabric.hivemind.dht import exit_with_parent
from swarm.fabric.hivemind.log_filters import DemoteHandled

logger = logging.getLogger(__name__)


NO_GROUP = "could not find a group"  # the end of hivemind's error for a round nobody joined (averager.py, _step)
FIXED_POINT_BITS = 24  # gradient * rows is sent in units of 2^-24
# |value| above this is clamped: with at most MAX_MEMBERS members the float64 average of integers
# below 2^43 comes back within 0.1 of the exact sum once multiplied by the member count
FIXED_POINT_LIMIT = float(2 ** 43)
MAX_MEMBERS = 64
# in the error of a round whose all-reduce came back incomplete (see GuardedAverager._run_allreduce_inplace_)
PARTIAL_ROUND = "incomplete all-reduce"
# while a round looks for its group, whether other learners are still present is asked this often;
# absent at this many asks in a row (one DHT read coming back empty is not enough), the round ends
PRESENCE_POLL_S = 1.0
ABSENT_POLLS = 2


# what a round or a state download may end with, all meaning "none this time": hivemind raises many
# kinds, and hands back asyncio's CancelledError (a BaseException, not an Exception) when its
# matchmaking gives up on a group it was assembling; let through, it would end the learner's loop
ROUND_FAILURES = (Exception, asyncio.CancelledError)


class NobodyLeft(Exception):
    """Every other learner left while this one looked for a group (their last records said so)."""


def await_round(control: StepControl, timeout_s: float, others_present: Callable[[], bool] | None) -> Any:
    """The round's result within `timeout_s`; while it still looks for a group, NobodyLeft once
    `others_present()` has said no ABSENT_POLLS times in a row (a learner that stops says it is
    leaving: the one left behind would otherwise wait out the whole timeout for it). A round whose
    all-reduce is under way is left to hivemind's own timeouts."""
    end, absent = time.time() + timeout_s, 0
    while True:
        left = end - time.time()
        try:
            return control.result(timeout=max(0.0, min(PRESENCE_POLL_S, left)))
        except concurrent.futures.TimeoutError:  # (not the builtin TimeoutError before Python 3.11)
            if control.done() or left <= PRESENCE_POLL_S or others_present is None:
                raise
        if control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP):
            try:
                absent = 0 if others_present() else absent + 1
            except Exception:  # noqa: BLE001  a failed read says nothing about who is there
                absent = 0
            if absent >= ABSENT_POLLS:
                raise NobodyLeft("every other learner left the run")


def to_fixed_point(grads: Sequence[torch.Tensor | None], shapes: Sequence[torch.Size], rows: int) -> tuple[torch.Tensor, int]:
    """The flat float64 vector of round(grad * rows * 2^24), and how many elements were clamped."""
    parts = [(g.detach().reshape(-1).to(torch.float64) if g is not None else torch.zeros(s.numel(), dtype=torch.float64))
             for g, s in zip(grads, shapes)]
    flat = torch.cat(parts) * (rows * 2.0 ** FIXED_POINT_BITS) if parts else torch.zeros(0, dtype=torch.float64)
    flat.round_()
    clamped = int((flat.abs() > FIXED_POINT_LIMIT).sum())
    return flat.clamp_(-FIXED_POINT_LIMIT, FIXED_POINT_LIMIT), clamped


def from_fixed_point(averaged: torch.Tensor, members: int, total_rows: int, shapes: Sequence[torch.Size],
                     dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """The mean gradient over all members' rows from the all-reduced fixed-point vector: the exact
    integer sum first (`round(average * members)`), so every member gets the same bits."""
    total = torch.round(averaged * members)
    mean = (total / (float(total_rows) * 2.0 ** FIXED_POINT_BITS)).to(dtype)
    out, start = [], 0
    for shape in shapes:
        out.append(mean[start:start + shape.numel()].view(shape))
        start += shape.numel()
    return out


@dataclass(frozen=True)
class MemberState:
    """What each member of a round says of itself (gathered with the gradients)."""

    peer_id: str
    version: int
    weights_hash: str
    rows: int


def canonical(states: Iterable[MemberState]) -> tuple[int, str]:
    """The (version, weights hash) a round's members should all hold: the newest version, the hash
    most of its holders share, ties to the lowest peer id's."""
    states = list(states)
    newest = max(s.version for s in states)
    holders = sorted((s for s in states if s.version == newest), key=lambda s: s.peer_id)
    counts: dict[str, int] = {}
    for s in holders:
        counts[s.weights_hash] = counts.get(s.weights_hash, 0) + 1
    best = max(counts.values())
    return newest, next(s.weights_hash for s in holders if counts[s.weights_hash] == best)


class GuardedAverager(DecentralizedAverager):
    """A DecentralizedAverager that deals only with the peer ids in its allow-list (see module doc).

    The averager runs in its own process; the allow-list reaches it through hivemind's command pipe."""

    _allowed: frozenset = frozenset()
    _state_source: Callable[[], tuple[Any, Sequence[torch.Tensor]]] | None = None

    def run(self) -> None:
        # like the DHT's process, the averager's (a fork of the learner) must not outlive a
        # learner killed with SIGKILL: it would linger with the model's buffers for good

        exit_with_parent(self._parent_pid)
        super().run()

    def set_allowed(self, peer_ids: Iterable[Any]) -> None:
        ids = sorted({p.to_bytes() if hasattr(p, "to_bytes") else bytes(p) for p in peer_ids})
        self._outer_pipe.send(("_set_allowed", [ids], {}))

    async def _set_allowed(self, ids: list[bytes]) -> None:
        self._allowed = frozenset(ids)
        # a group of every learner present starts its round at once, instead of waiting out the
        # matchmaking time for followers that are not coming
        if getattr(self, "_matchmaking", None) is not None:
            self._matchmaking.target_group_size = max(2, len(self._allowed))

    def _refuses(self, peer) -> bool:
        return peer.to_bytes() not in self._allowed

    async def rpc_join_group(self, request, context):
        if self._refuses(context.remote_id):
            logger.warning("refused an averaging join request from unauthorised peer %s", context.remote_id)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_aggregate_part(self, stream, context):
        if self._refuses(context.remote_id):
            logger.warning("refused averaging parts from unauthorised peer %s", context.remote_id)
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(self, request, context):
        if self._refuses(context.remote_id):
            logger.warning("refused a state download by unauthorised peer %s", context.remote_id)
            return
        async for message in super().rpc_download_state(request, context):
            yield message

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        """hivemind's all-reduce, failed when it came back incomplete. hivemind tolerates a reducer
        that fails (its part keeps this member's own values) and a sender that stalls (the part is
        averaged without it), and reports success: the members then hold different means, or a
        mean divided by rows it does not hold, and their weights part. CI saw it ("received
        91.8% results"): two learners published different weights as one version. Failed, the
        round is tried again from this learner's own contribution (LearnerGroup.average)."""
        await super()._run_allreduce_inplace_(tensors, group_info, group_id=group_id, **kwargs)
        runner = self._running_groups[group_info.group_id if group_id is None else group_id].result()
        missing, banned = runner.tensor_part_container.failed_size, runner.banned_senders
        if missing or banned:
            raise AllreduceException(f"{PARTIAL_ROUND}: {missing} of {runner.tensor_part_container.total_size} "
                                     f"values came back unaveraged, {len(banned)} sender(s) left out")

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        strangers = [p for p in group_info.peer_ids if p != self.peer_id and self._refuses(p)]
        if strangers:  # a rogue leader's group: leave before any tensor is sent
            raise AllreduceException(f"group holds unauthorised peer(s) {[str(p) for p in strangers]}")
        if len(group_info.peer_ids) > MAX_MEMBERS:
            raise AllreduceException(f"group of {len(group_info.peer_ids)} exceeds {MAX_MEMBERS} learners")
        return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)

    # hivemind's servicer reads each handler's message types from its annotations, and this
    # module's annotations are strings (from __future__): give the real types
    rpc_join_group.__annotations__ = dict(request=averaging_pb2.JoinRequest, context=P2PContext,
                                          return_=AsyncIterator[averaging_pb2.MessageFromLeader])
    rpc_aggregate_part.__annotations__ = dict(stream=AsyncIterator[averaging_pb2.AveragingData], context=P2PContext,
                                              return_=AsyncIterator[averaging_pb2.AveragingData])
    rpc_download_state.__annotations__ = dict(request=averaging_pb2.DownloadRequest, context=P2PContext,
                                              return_=AsyncIterator[averaging_pb2.DownloadData])
    for handler in (rpc_join_group, rpc_aggregate_part, rpc_download_state):
        handler.__annotations__["return"] = handler.__annotations__.pop("return_")

    async def _download_from(self, peers: list[bytes], timeout: float, future) -> None:
        """The first state that one of `peers` (in order) serves; hivemind's own loader asks
        whoever declared itself under the run's key, unauthorised peers included."""

        try:
            for raw in peers:
                peer = PeerID(raw)
                if peer == self.peer_id or self._refuses(peer):
                    continue
                metadata = []

                async def parts(stream):
                    async for message in aiter_with_timeout(stream, timeout=timeout):
                        if message.metadata:
                            metadata.append(message.metadata)
                        yield [message.tensor_part]

                try:
                    stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
                    stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
                    tensors = await deserialize_tensor_stream(parts(stream))
                except Exception as exc:  # noqa: BLE001 - try the next one
                    logger.warning("state download from %s failed: %r", peer, exc)
                    continue
                if metadata:
                    future.set_result((str(peer), self.serializer.loads(metadata[0]), tensors))
                    return
        finally:
            if not future.done():
                future.set_result(None)

    def get_current_state(self):
        if self._state_source is None:
            return None, [], None
        metadata, tensors = self._state_source()
        return metadata, list(tensors), None



@dataclass
class RoundResult:
    """One averaging round as this learner saw it."""

    members: list[MemberState]
    grads: list[torch.Tensor] | None  # the mean gradient over all members' rows; None: step alone or resync
    total_rows: int
    canonical: tuple[int, str]
    in_step: bool  # whether this learner holds the canonical state (else it must resynchronise)
    seconds: float
    clamped: int = 0
    bytes_sent: int = 0  # this learner's share of all-reduce traffic, upper bound: 2 x its vector
    error: str = ""
    extra: dict = field(default_factory=dict)
    # a group formed but its all-reduce came back incomplete (and no later attempt succeeded): the
    # others may have stepped on a full result, so this learner must not step alone
    partial: bool = False


def _nobody_joined(record: logging.LogRecord, failure: BaseException | None) -> bool:
    """hivemind's averager logs a round nobody joined at ERROR, with a traceback ("could not find a
    group"), though that is no error here: `LearnerGroup.average` returns the failure, and the learner
    records it (an `averaging_alone` event) and steps alone. A learner whose partner had stopped
    printed a traceback for every round. Other failed rounds (a group with an unauthorised peer, an
    incomplete all-reduce) are still shown."""
    nobody_came = isinstance(failure, AllreduceException) and str(failure).endswith(NO_GROUP)
    return nobody_came or isinstance(failure, asyncio.CancelledError)


# before any averager process forks: they inherit it
logging.getLogger("hivemind.averaging.averager").addFilter(DemoteHandled(_nobody_joined))


class LearnerGroup:
    """This learner's membership of the run's averaging group (hivemind transport).

    `average(...)` runs one round; `download_state(...)` fetches the canonical state from another
    member; `serve_state(fn)` sets what others download from here. Thread-safe enough for one
    training thread plus hivemind's own state-serving thread (the state source takes its own lock)."""

    def __init__(self, dht, run_id: str, parameters: Sequence[torch.nn.Parameter], *, matchmaking_s: float = 3.0,
                 request_timeout_s: float = 2.0, allreduce_timeout_s: float = 30.0) -> None:
        self.shapes = [p.shape for p in parameters]
        numel = sum(s.numel() for s in self.shapes)
        self.buffer = torch.zeros(numel, dtype=torch.float64)
        # prefix: one averaging group per run (no '.' allowed in it by hivemind)
        self.averager = GuardedAverager([self.buffer], dht, start=True, prefix=f"{run_id.replace('.', '_')}_learners",
                                        min_matchmaking_time=matchmaking_s, request_timeout=request_timeout_s,
                                        allreduce_timeout=allreduce_timeout_s, min_group_size=2,
                                        next_chunk_timeout=request_timeout_s, allow_state_sharing=True, declare_state_period=5.0)
        self.peer_id = str(self.averager.peer_id)
        self.matchmaking_s, self.allreduce_timeout_s = matchmaking_s, allreduce_timeout_s
        self._lock = threading.Lock()

    def allow(self, peer_ids: Iterable[str]) -> None:
        """The libp2p peer ids of the run's authorised learners (this one's included)."""

        self.averager.set_allowed([PeerID.from_base58(p) for p in set(peer_ids) | {self.peer_id}])

    def serve_state(self, source: Callable[[], tuple[dict, Sequence[torch.Tensor]]], version: int) -> None:
        """What a joining or diverged learner downloads from here; newer versions are asked first."""
        self.averager._state_source = source
        self.averager.state_sharing_priority = float(version)

    def average(self, grads: Sequence[torch.Tensor | None], rows: int, version: int, weights_hash: str,
                timeout_s: float, others_present: Callable[[], bool] | None = None) -> RoundResult:
        """One round with whichever authorised learners are averaging now. `rows` 0 contributes nothing
        (a learner with no groups, or a non-finite gradient) but still takes the group's step. With
        `others_present`, a round still looking for its group ends when nobody else is left."""
        started = time.time()
        fixed, clamped = to_fixed_point(grads, self.shapes, rows)
        if clamped:
            logger.warning("%d gradient element(s) clamped to the fixed-point range", clamped)
        me = MemberState(self.peer_id, version, weights_hash, rows)
        with self._lock:
            gathered, error, partial = None, "", ""  # partial: the error of an attempt that came back incomplete
            deadline = time.time() + timeout_s
            # one attempt at a time, each from this learner's own contribution: hivemind's own retries
            # would go on from a buffer that a failed all-reduce left partly averaged
            # hivemind asserts that an attempt's timeout holds its matchmaking window: the first attempt
            # is given one at least, and a retry that would not fit is not made
            fits = self.matchmaking_s + 0.5
            while True:
                with self.averager.get_tensors() as (buffer,):
                    buffer.copy_(fixed)
                remaining = max(fits, deadline - time.time())
                control = self.averager.step(gather=dict(version=version, hash=weights_hash, rows=rows), weight=1.0,
                                             timeout=remaining, allow_retries=False, wait=False)
                try:  # hivemind's timeout bounds finding a group, not a round that then stalls: bound both
                    gathered = await_round(control, remaining + self.allreduce_timeout_s, others_present)
                except ROUND_FAILURES as exc:
                    control.cancel()
                    error = f"{type(exc).__name__}: {exc}"
                    partial = partial or (error if PARTIAL_ROUND in error else "")
                    if isinstance(exc, NobodyLeft):
                        break
                if gathered or deadline - time.time() <= fits:
                    break
            if not gathered:
                return RoundResult([me], None, rows, (version, weights_hash), True, time.time() - started, clamped,
                                   error=partial or error or "no group", partial=bool(partial))
            members = []
            for peer, data in gathered.items():
                try:
                    members.append(MemberState(str(peer), int(data["version"]), str(data["hash"]), max(0, int(data["rows"]))))
                except (KeyError, TypeError, ValueError):
                    return RoundResult([me], None, rows, (version, weights_hash), True, time.time() - started, clamped,
                                       error=f"malformed metadata from {peer}")
            target = canonical(members)
            total_rows = sum(m.rows for m in members)
            in_step = (version, weights_hash) == target
            result = RoundResult(members, None, total_rows, target, in_step, time.time() - started, clamped,
                                 bytes_sent=2 * fixed.numel() * 8)
            if not in_step or total_rows == 0:
                return result
            with self.averager.get_tensors() as (buffer,):
                mean = from_fixed_point(buffer, len(members), total_rows, self.shapes)
            if not all(torch.isfinite(g).all() for g in mean):
                result.error = "non-finite averaged gradient"
                return result
            result.grads = mean
            return result

    def download_state(self, peers: Sequence[str], timeout_s: float) -> tuple[str, dict, list[torch.Tensor]] | None:
        """(peer, metadata, tensors) from the first of `peers` (authorised learners' peer ids, in the
        order to ask) that serves its state; None if none did. The caller checks what it got."""

        future = MPFuture()
        ids = [PeerID.from_base58(p).to_bytes() for p in peers]
        self.averager._outer_pipe.send(("_download_from", [ids, timeout_s], dict(future=future)))
        try:
            found = future.result(timeout=timeout_s * max(1, len(ids)) + 5)
        except ROUND_FAILURES as exc:
            logger.warning("state download failed: %s", exc)
            return None
        if not found or not isinstance(found[1], dict):
            return None
        return found[0], found[1], list(found[2])

    def close(self) -> None:
        if not self.averager.is_alive():  # gone already (its learner's stop reached it first): hivemind's
            # shutdown would log an ERROR saying only that, and leave its state-fetching thread waiting
            self.averager._inner_pipe.send(("_SHUTDOWN", None))  # what that shutdown sends the thread
            return
        try:
            self.averager.shutdown()
        except Exception:  # noqa: BLE001 - an averager that dies while it is shut down
            pass
