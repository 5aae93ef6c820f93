"""A weight holder closes a p2p stream only after its requester has: the daemon can turn a
holder's early close into a reset that throws away the answer's unread tail (close_after_requester)."""

import asyncio
import contextlib
import socket
import time

import msgpack

from swarm.fabric.local import LocalFabrics
from swarm.fabric.hivemind.loop import StreamClient, close_after_requester
from swarm.fabric.weights.versions import VersionStore
from swarm.fabric.hivemind.weights import handler_name

RUN = "stream-close-test"


@contextlib.contextmanager
def served_version(side: int, thread_name: str):
    """(holder, its weight server of version 0, a requester's StreamClient) over two real hivemind peers."""
    import torch

    store = VersionStore()
    store.add(0, {"w": torch.randn(side, side)})
    with LocalFabrics("hivemind", RUN) as fabrics:
        holder, requester = fabrics.make(), fabrics.make()
        yield holder, holder.weight_server(store), StreamClient(requester.dht, handler_name(RUN), thread_name=thread_name)


def test_a_holder_keeps_the_stream_open_until_its_requester_closes():
    """A requester that has read the whole answer and waits: the holder's end stays open (no EOF
    for a second), so nothing the daemons still carry can be reset away. The old handler closed
    at once, and a loaded machine lost a 9 MiB snapshot's last MiB to the reset that followed."""
    from hivemind.p2p import P2P

    with served_version(512, "close-test") as (holder, server, client):

        async def ask_then_wait() -> tuple[int, int, bytes | None]:
            reader, writer = await client.open(holder.peer_id)
            try:
                await P2P.send_raw_data(msgpack.packb({"have": None, "want": 0}), writer)
                header = msgpack.unpackb(await P2P.receive_raw_data(reader), raw=False)
                payload = await P2P.receive_raw_data(reader)
                try:  # the whole answer is in; the holder must not hang up on us now
                    early = await asyncio.wait_for(reader.read(1), 1.0)
                except asyncio.TimeoutError:
                    early = None
                return header["count"], len(payload), early
            finally:
                writer.close()

        try:
            count, size, early = client.run(ask_then_wait(), timeout=30)
            assert count == 1 and size > 512 * 512 * 2
            assert early is None, f"the holder closed the stream before the requester did (read {early!r})"
            assert server.served == 1
        finally:
            client.close()
            server.close()


async def _stream_pair():
    """(holder's reader, holder's writer, requester's reader, requester's writer) over a socketpair."""
    left, right = socket.socketpair()
    holder_reader, holder_writer = await asyncio.open_connection(sock=left)
    requester_reader, requester_writer = await asyncio.open_connection(sock=right)
    return holder_reader, holder_writer, requester_reader, requester_writer


def test_the_holder_closes_when_the_requester_does_and_gives_up_on_one_that_never_does():
    async def scenario() -> tuple[float, float, bytes]:
        h_reader, h_writer, r_reader, r_writer = await _stream_pair()
        started = time.monotonic()
        r_writer.write(b"late bytes nobody wants")  # read and dropped, not an error
        r_writer.close()
        await close_after_requester(h_reader, h_writer, timeout=10)
        prompt = time.monotonic() - started

        h_reader, h_writer, r_reader, r_writer = await _stream_pair()
        started = time.monotonic()
        await close_after_requester(h_reader, h_writer, timeout=0.3)  # this requester never closes
        bounded = time.monotonic() - started
        after_bound = await asyncio.wait_for(r_reader.read(), 5)  # EOF: the holder did close
        r_writer.close()
        return prompt, bounded, after_bound

    prompt, bounded, after_bound = asyncio.run(scenario())
    assert prompt < 2, f"the holder waited {prompt:.2f} s for a requester that had already closed"
    assert 0.25 <= bounded < 3, f"the holder gave up on a silent requester after {bounded:.2f} s, not about 0.3 s"
    assert after_bound == b""


def test_a_closing_server_does_not_wait_for_requesters():
    """Cancelled (the server closes): the stream is closed at once, not after the linger."""
    async def scenario() -> tuple[float, bytes]:
        h_reader, h_writer, r_reader, r_writer = await _stream_pair()

        async def handler() -> None:
            try:
                await asyncio.sleep(60)  # an answer still being sent when the server closes
            except asyncio.CancelledError:
                pass  # as WeightServer._handle does
            finally:
                await close_after_requester(h_reader, h_writer, timeout=30)

        task = asyncio.create_task(handler())
        await asyncio.sleep(0.05)
        started = time.monotonic()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        took = time.monotonic() - started
        eof = await asyncio.wait_for(r_reader.read(), 5)
        r_writer.close()
        return took, eof

    took, eof = asyncio.run(scenario())
    assert took < 2 and eof == b""


def test_a_server_closed_while_a_requester_lingers_logs_no_traceback(caplog):
    """The learner stopped by Ctrl-C while a sampler still held a weight stream open: the handler's
    task was cancelled in its wait for the requester's close and ended cancelled, and asyncio's
    stream callback (Python 3.11) printed a CancelledError traceback into the learner's output."""
    from hivemind.p2p import P2P

    with served_version(64, "linger-test") as (holder, server, client):

        async def ask_and_hold():
            reader, writer = await client.open(holder.peer_id)
            await P2P.send_raw_data(msgpack.packb({"have": None, "want": 0}), writer)
            msgpack.unpackb(await P2P.receive_raw_data(reader), raw=False)
            await P2P.receive_raw_data(reader)
            return writer  # left open: the holder lingers for our close

        try:
            writer = client.run(ask_and_hold(), timeout=30)
            deadline = time.monotonic() + 10
            while server.served < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server.served == 1
            with caplog.at_level("ERROR", logger="asyncio"):
                server.close()  # cancels the lingering handler
            errors = [r for r in caplog.records if r.name == "asyncio" and r.levelname == "ERROR"]
            assert not errors, [r.getMessage() for r in errors]
            writer.close()
        finally:
            client.close()
            server.close()


def test_a_cancelled_stream_ends_quietly_and_another_cancellation_still_propagates(caplog):
    """The handler wrapper ends a stream its server's close cancelled (task.cancelling() set), but
    lets through a CancelledError that is not that (an awaited future someone else cancelled); and a
    stream task the loop's stop cancelled before it reached the handler is a debug line, not asyncio's
    'Exception in callback'."""
    from swarm.fabric.hivemind.loop import _ends_quietly_when_cancelled, _quiet_late_streams

    async def scenario() -> tuple[str, bytes, str]:
        h_reader, h_writer, r_reader, r_writer = await _stream_pair()

        async def lingers(info, reader, writer):
            await asyncio.sleep(60)

        task = asyncio.create_task(_ends_quietly_when_cancelled(lingers)(None, h_reader, h_writer))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ended = "cancelled" if task.cancelled() else "normally"
        eof = await asyncio.wait_for(r_reader.read(), 5)  # the wrapper closed the stream
        r_writer.close()

        async def awaits_a_cancelled_future(info, reader, writer):
            future = asyncio.get_running_loop().create_future()
            future.cancel()
            await future

        h_reader, h_writer, _, r_writer = await _stream_pair()
        other = asyncio.create_task(_ends_quietly_when_cancelled(awaits_a_cancelled_future)(None, h_reader, h_writer))
        await asyncio.gather(other, return_exceptions=True)
        r_writer.close()
        h_writer.close()
        return ended, eof, "cancelled" if other.cancelled() else "normally"

    ended, eof, other = asyncio.run(scenario())
    assert (ended, eof, other) == ("normally", b"", "cancelled")

    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level("DEBUG"):
            _quiet_late_streams(loop, {"message": "Exception in callback", "exception": asyncio.CancelledError()})
            _quiet_late_streams(loop, {"message": "something else", "exception": ValueError("shown")})
    finally:
        loop.close()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == ["something else"], errors


def test_a_stream_closed_after_its_loop_has_closed_raises_nothing():
    """A request coroutine finalised after its loop closed (its client dropped while it was pending)
    closes its stream in `finally`: plain `writer.close()` raised "Event loop is closed" there, which
    Python printed as an ignored exception with a traceback; close_stream has nothing left to do."""
    from swarm.fabric.hivemind.loop import close_stream

    loop = asyncio.new_event_loop()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        async def two_streams():
            return [await asyncio.open_connection(*listener.getsockname()) for _ in range(2)]

        writers = loop.run_until_complete(two_streams())
    loop.close()
    (_, plain), (_, ours) = writers
    try:
        plain.close()
    except RuntimeError as exc:
        assert str(exc) == "Event loop is closed"  # what the coroutine's finally met
    else:
        raise AssertionError("closing a stream of a closed loop raised nothing: the case this guards is gone")
    close_stream(ours)
    for writer in (plain, ours):  # their sockets, which the closed loop can no longer close
        sock, writer.transport._sock = writer.transport._sock, None
        sock.close()


def test_a_call_on_a_loop_that_stops_before_running_it_fails_at_once_and_closes_its_coroutine():
    """A call that races the loop's close: its coroutine is handed over just as the loop stops,
    and never runs. The caller got no answer for ever (with no timeout), or a TimeoutError and, at
    garbage collection, "coroutine ... was never awaited" (seen in CI's log); now it gets a
    RuntimeError within a second, and the coroutine is closed."""
    import gc
    import inspect
    import warnings

    from swarm.fabric.hivemind.loop import LIVENESS_CHECK_S, BackgroundLoop

    io = BackgroundLoop("race-test")
    io.loop.call_soon_threadsafe(io.loop.stop)  # the loop stops without the `stopped` flag a close sets first
    io._thread.join(timeout=5)
    assert not io._thread.is_alive()

    async def never_run():
        return "ran"

    coro = never_run()
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            io.run(coro)
        except RuntimeError as exc:
            assert "stopped" in str(exc)
        else:
            raise AssertionError("a call on a stopped loop returned")
        gc.collect()
    assert time.monotonic() - started < LIVENESS_CHECK_S + 2
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED
    assert not [w for w in caught if "never awaited" in str(w.message)], [str(w.message) for w in caught]
    io.loop.close()


def test_a_call_waits_past_the_liveness_slices_for_its_result_and_keeps_its_own_errors():
    """BackgroundLoop.run waits in slices of LIVENESS_CHECK_S: a call longer than one slice still gets
    its result (with no timeout too), a timeout still ends a call with TimeoutError, and a TimeoutError
    the coroutine raised itself comes back as it is, at once (not taken for a slice ending)."""
    from swarm.fabric.hivemind.loop import LIVENESS_CHECK_S, BackgroundLoop

    io = BackgroundLoop("slices-test")
    try:
        async def slow(value):
            await asyncio.sleep(2.5 * LIVENESS_CHECK_S)
            return value

        assert io.run(slow("late")) == "late"
        assert io.run(slow("in time"), timeout=10 * LIVENESS_CHECK_S) == "in time"
        started = time.monotonic()
        try:
            io.run(slow("too late"), timeout=0.3)
        except TimeoutError:
            assert time.monotonic() - started < 0.3 + LIVENESS_CHECK_S
        else:
            raise AssertionError("a call past its timeout returned")

        async def own_timeout():
            await asyncio.wait_for(asyncio.sleep(10), 0.05)

        started = time.monotonic()
        try:
            io.run(own_timeout())
        except TimeoutError:
            assert time.monotonic() - started < LIVENESS_CHECK_S  # its own, at once
        else:
            raise AssertionError("the coroutine's TimeoutError was lost")
    finally:
        io.stop()
    try:
        io.run(slow("after the stop"))
    except RuntimeError as exc:
        assert "stopped" in str(exc)
    else:
        raise AssertionError("a call after stop() ran")
