"""A stream that reaches a weight server the moment it closes (issue 47: a learner's normal end of
run printed `KeyError: 'gepo-swarm/swarm/weights/v1'`, then `DispatchFailure`): its requester sees
the stream end, and the server's peer prints nothing. Real daemons on loopback."""

import gc
import logging

import msgpack

from swarm.fabric.hivemind.loop import StreamClient
from swarm.fabric.hivemind.weights import handler_name
from swarm.fabric.local import LocalFabrics
from swarm.fabric.weights.versions import VersionStore

RUN = "late-stream-test"


def test_a_stream_dispatched_to_a_handler_just_removed_is_no_traceback(caplog):
    from hivemind.p2p import P2P

    with LocalFabrics("hivemind", RUN) as fabrics:
        holder, requester = fabrics.make(), fabrics.make()
        server = holder.weight_server(VersionStore())
        client = StreamClient(requester.dht, handler_name(RUN), thread_name="late-test")
        # the race, held open: the daemon still routes the protocol to this peer, whose dispatcher has
        # already dropped the handler (as between its removal and the daemon's forgetting it)
        host = server._host
        del host.p2p._client.control.handlers[handler_name(RUN)]

        async def ask():
            reader, writer = await client.open(holder.peer_id)
            try:
                await P2P.send_raw_data(msgpack.packb({"have": None, "want": 0}), writer)
                return await reader.read(1)
            finally:
                writer.close()

        try:
            with caplog.at_level(logging.DEBUG, logger="swarm.fabric.hivemind.loop"):
                try:
                    answer = client.run(ask(), timeout=30)
                except Exception:  # noqa: BLE001  a reset stream is as good an answer: nothing was served
                    answer = b""
                host.io.run(_settle(), timeout=10)
                gc.collect()  # an unretrieved task exception is reported when the task is collected
                host.io.run(_settle(), timeout=10)
        finally:
            client.close()
            server.close()
    assert answer == b""
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert loud == [], [r.getMessage() for r in loud]
    assert any("reached a closed handler" in r.getMessage() for r in caplog.records)


async def _settle():
    import asyncio

    await asyncio.sleep(0.5)
