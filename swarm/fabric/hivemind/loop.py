"""A private asyncio event loop in a daemon thread, so synchronous peer code can call the
hivemind P2P API (which is asyncio-only) with a timeout on every call."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
import time
from typing import Awaitable, TypeVar

from hivemind.dht import DHT
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import DispatchFailure

logger = logging.getLogger(__name__)

T = TypeVar("T")

LIVENESS_CHECK_S = 1.0  # how often a caller waiting on the loop checks that its thread still runs


class BackgroundLoop:
    def __init__(self, name: str = "swarm-io") -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(_quiet_late_streams)
        self.stopped = False
        # a call hands its coroutine over under this lock, and a stop marks the loop stopped under it
        # before it cancels what runs: a coroutine handed over is then among what the stop cancels,
        # never a task left pending on a stopped loop ("Task was destroyed but it is pending!")
        self._handing_over = threading.Lock()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (TimeoutError after `timeout` seconds;
        RuntimeError at once when the loop has stopped: nothing would ever run it)."""
        with self._handing_over:
            future = None if self.stopped else asyncio.run_coroutine_threadsafe(coro, self.loop)
        if future is None:  # by a close before this one (a second close, a teardown)
            _close_unstarted(coro)
            raise RuntimeError("the event loop has stopped")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # in slices: a loop whose thread has died (not by stop()) never runs `coro`, and a caller
            # with no timeout would otherwise wait for ever
            wait = LIVENESS_CHECK_S if deadline is None else min(LIVENESS_CHECK_S, max(0.0, deadline - time.monotonic()))
            try:
                return future.result(wait)
            except FUTURE_TIMEOUTS:
                if future.done():
                    raise  # the coroutine's own TimeoutError (one of its awaits timed out)
                if not self._thread.is_alive():
                    future.cancel()
                    _close_unstarted(coro)
                    raise RuntimeError("the event loop stopped before this call finished") from None
                if deadline is not None and time.monotonic() >= deadline:
                    future.cancel()
                    raise TimeoutError(f"no result within {timeout:g} s") from None

    def stop(self) -> None:
        """Cancel what is still running (open streams close through their own `finally`), then stop."""
        with self._handing_over:
            self.stopped = True  # no call hands a coroutine over after this
        if not self.loop.is_running():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(5)
        except Exception:  # noqa: BLE001  a task that will not die must not block shutdown
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


# what future.result(timeout) raises when the time is up (one class from Python 3.11; two before)
FUTURE_TIMEOUTS = (TimeoutError, concurrent.futures.TimeoutError)


def _close_unstarted(coro) -> None:
    """Close a coroutine that never started and never will: rather than "never awaited" at exit."""
    if asyncio.iscoroutine(coro) and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
        coro.close()


def _quiet_late_streams(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """A stream that reaches a handler just removed (the daemon dispatched it a moment before a peer
    closed its weight server or inbox, as at a learner's end of run) fails in hivemind's dispatcher
    with DispatchFailure, which asyncio printed as two tracebacks (KeyError, then DispatchFailure).
    Its requester sees a closed stream and asks elsewhere: that is a debug line. So is a stream task
    cancelled by the loop's stop before it reached the handler (see _ends_quietly_when_cancelled).
    Anything else goes to asyncio's own handler."""
    if isinstance(context.get("exception"), DispatchFailure):
        logger.debug("a stream reached a closed handler: %s", context["exception"])
        return
    if isinstance(context.get("exception"), asyncio.CancelledError):  # a stream's task cancelled as the loop
        logger.debug("a stream cancelled at its handler's close: %s", context.get("message"))  # stops, before
        return  # it reached our handler (hivemind's dispatcher still reading the stream's header)
    loop.default_exception_handler(context)


async def replicate_p2p(daemon_maddr):
    return await P2P.replicate(daemon_maddr)


def attach_p2p(dht, io: BackgroundLoop, timeout: float = 30.0):
    """A P2P client of `dht`'s daemon, bound to `io`'s loop. (DHT.replicate_p2p caches one replica
    per DHT, bound to whichever loop asked first; every component here has its own loop.)"""

    maddr = dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr)
    return io.run(replicate_p2p(maddr), timeout=timeout)


def detach_p2p(p2p, io: BackgroundLoop) -> None:
    """Close the client (the daemon belongs to the DHT and keeps running), then stop the loop."""
    try:
        io.run(p2p.shutdown(), timeout=10)
    except Exception:  # noqa: BLE001  the daemon may already be gone
        pass
    io.stop()


async def close_after_requester(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float) -> None:
    """Close a served stream once the requester has closed its end, or after `timeout` (a requester
    that never closes costs one idle coroutine this long).

    The p2p daemon turns a handler's close into a reset of the whole stream as soon as its read
    side ends (go-libp2p-daemon's doStreamPipe: `s.Close()` when the handler's socket ends, then
    the read still pending on `s` fails and calls `s.Reset()`), and a reset throws away whatever
    the requester's daemon still holds unread: the tail of a payload went missing that way (about
    1 MiB of a 9 MiB snapshot read in one piece). Every requester here closes as soon as it has
    read all it wants, so waiting for that EOF first loses nothing and costs only the wait. (Only
    for handlers whose requester closes once answered: a rollout sender stops at a `final` refusal.)"""
    task = asyncio.current_task()
    try:
        if task is None or not task.cancelling():  # the server is closing: no waiting then
            await asyncio.wait_for(_read_to_eof(reader), timeout)
    except (asyncio.TimeoutError, ConnectionError):
        pass
    finally:
        writer.close()


def close_stream(writer: asyncio.StreamWriter) -> None:
    """Close a stream from a coroutine's `finally`, which also runs when the coroutine is finalised after
    its loop has closed (a request still pending when its client was dropped, collected later): closing
    then raised "Event loop is closed", printed as an ignored exception. Nothing is left to send then."""
    try:
        writer.close()
    except RuntimeError as exc:
        if str(exc) != "Event loop is closed":  # asyncio's own words (BaseEventLoop._check_closed)
            raise


async def _read_to_eof(reader: asyncio.StreamReader) -> None:
    while await reader.read(64 * 1024):  # what a requester still sends is not wanted any more
        pass


def _ends_quietly_when_cancelled(handler):
    """`handler`, ending normally when the server's close cancels it. asyncio runs each stream's
    handler as a task whose done-callback (streams.py, Python 3.11) calls `task.exception()`, which
    raises on a cancelled task: the loop then printed a CancelledError traceback for every stream
    still open at a peer's stop (a sampler lingering over a weight answer at the learner's Ctrl-C)."""

    async def served(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(stream_info, reader, writer)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or not task.cancelling():
                raise  # not this stream's task cancelled (an awaited future's own cancellation): not ours to end
            writer.close()  # the server is closing: the stream ends with it

    return served


class HostedStreamHandler:
    """A named binary stream handler on `dht`'s p2p daemon, served from its own loop thread."""

    def __init__(self, dht, name: str, handler, *, thread_name: str) -> None:
        self.name = name
        self.io = BackgroundLoop(thread_name)
        self.p2p = attach_p2p(dht, self.io)
        self.io.run(self.p2p.add_binary_stream_handler(name, _ends_quietly_when_cancelled(handler)), timeout=30)
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.io.run(self.p2p.remove_binary_stream_handler(self.name), timeout=10)
        except Exception:  # noqa: BLE001  the daemon may already be gone
            pass
        detach_p2p(self.p2p, self.io)


class StreamClient:
    """Opens streams to a named handler on other peers, from its own loop thread."""

    def __init__(self, dht, name: str, *, thread_name: str) -> None:
        self.name = name
        self.io = BackgroundLoop(thread_name)
        self.p2p = attach_p2p(dht, self.io)
        self.closed = False

    def run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        return self.io.run(coro, timeout)

    async def open(self, peer_id):
        """(reader, writer) of a new stream to `peer_id` (a PeerID or its base58 string)."""

        if isinstance(peer_id, str):
            peer_id = PeerID.from_base58(peer_id)
        _, reader, writer = await self.p2p.call_binary_stream_handler(peer_id, self.name)
        return reader, writer

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            detach_p2p(self.p2p, self.io)
