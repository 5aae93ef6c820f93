"""A slow link in the middle of a chain (swarm/fabric/weights/upstream_pace.py), with real holders on
loopback: the peer after the slow one passes it over for the peer before it, the peer after that
keeps its own upstream (no cascade), and on equal links nobody is passed over. The slow link is the
slow peer's download: its client takes every chunk's bytes at SLOW_BYTES_S (a real fetch whose
reads are throttled, as a 20 Mbit/s line throttles them; it passes them on as slowly)."""

import threading
import time

import pytest

from swarm.fabric.weights import upstream_pace
from swarm.fabric.weights.upstream_pace import PASSES, PROBE_AFTER_CHUNKS, PROBES, WALK_AFTER_UNSURE, UpstreamPace
from swarm.fabric.weights.versions import VersionStore
from swarm.fabric.weights.upload_slots import UploadSlots
from tests.fabric.weights.test_chunked_fetch import fetch_by, learner_with_a_snapshot
from tests.helpers.retries import twice_on_a_loaded_machine

SLOW_BYTES_S = 80_000  # the slow peer's download: its ~265 KB snapshot in about 3.3 s
CHUNK = 1 << 14  # 17 chunks: its downstream judges its pace over two probes of two chunks each; a probe on
# loopback is a round trip (about 0.7 MB/s for 16 KiB), well over PASS_RATIO times the slow link


class SlowLink:
    """A download link of `bytes_s`: the bytes of every request through it take their turn at that rate."""

    def __init__(self, bytes_s: float) -> None:
        self.bytes_s, self._free, self._lock = bytes_s, time.monotonic(), threading.Lock()

    def carry(self, size: int) -> None:
        with self._lock:
            self._free = max(self._free, time.monotonic()) + size / self.bytes_s
            until = self._free
        time.sleep(max(0.0, until - time.monotonic()))


def throttled(client, bytes_s: float) -> None:
    """`client` receives chunks through a SlowLink: each piece's bytes are held back their time on
    it before they are read on (and passed on: the sink hears them as late)."""
    piece, link = client.piece, SlowLink(bytes_s)

    def slow_piece(holder, spec, index, wait_s=0.0, *, sink=None, **options):
        def slow_sink(data: bytes) -> None:
            link.carry(len(data))
            sink(data)

        data = piece(holder, spec, index, wait_s, sink=slow_sink if sink is not None else None, **options)
        if sink is None:  # the bytes came at once: held back as long as the link takes for them
            link.carry(len(data))
        return data
    client.piece = slow_piece


def chain_of_four(make_fabric, slow_place: int | tuple[int, ...] | None, chunk: int = CHUNK, slow_bytes_s: float = SLOW_BYTES_S):
    """Four sharers fetching a snapshot along one chain (sorted by peer id), the one at `slow_place`
    (or each of several) behind a slow download: (fetches in chain order, finish times, the
    learner's bytes served, size)."""
    learner, store, _ = learner_with_a_snapshot(make_fabric)
    store.book.chunk_bytes = chunk
    spec = next(s for s in store.chunk_specs(0) if s.kind == "snapshot")
    server = learner.weight_server(store)
    peers = sorted((make_fabric() for _ in range(4)), key=lambda peer: peer.peer_id)
    sharers = [peer.peer_id for peer in peers]
    stores = [VersionStore() for _ in peers]
    servers = [peer.weight_server(s) for peer, s in zip(peers, stores)]
    fetches = [fetch_by(peer, s.book, spec, [learner.peer_id], sharers) for peer, s in zip(peers, stores)]
    for place in (slow_place,) if isinstance(slow_place, int) else slow_place or ():
        throttled(fetches[place].client, slow_bytes_s)
    done, payloads = {}, {}

    def run(fetch):
        payloads[fetch.me] = fetch.run().payload()
        done[fetch.me] = time.monotonic()
    threads = [threading.Thread(target=run, args=(f,)) for f in fetches]
    started = time.monotonic()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        time.sleep(0.2)  # the learner counts a chunk's bytes once it has sent them
        assert list(payloads.values()) == [store.payload("snapshot", 0)] * 4
        return fetches, {peer: at - started for peer, at in done.items()}, server.bytes_served, spec.size
    finally:
        for f in fetches:
            f.client.close()
        for s in [server, *servers]:
            s.close()


# gRPC only: over hivemind on loopback, a probe of the peer that serves the throttled slow one ran at
# 0.16-0.24 MB/s against the slow one's 0.04-0.11, under PASS_RATIO in 1 run of 6 (no pass-over); the
# mechanism is the transport's same code, and benchmarks/fanout_wan.py measures it over hivemind on
# shaped links (GEPO_FANOUT_SLOW_PLACE)
@pytest.mark.parametrize("make_fabric, slow_place", [("grpc", 1), ("grpc", 0)], indirect=["make_fabric"])
def test_the_peer_after_a_slow_one_passes_it_over_and_the_peer_after_that_keeps_its_upstream(make_fabric, slow_place):
    """The slow one second (the third passes it over for the head) or heading the chain (the
    second passes it over for the learner, and heads the chain itself)."""
    def scenario():
        fetches, finished, served, size = chain_of_four(make_fabric, slow_place=slow_place)
        slow, after, last = fetches[slow_place], fetches[slow_place + 1], fetches[-1]
        print(f"{make_fabric.transport}, slow one at {slow_place}: finished after "
              + ", ".join(f"{t:.2f}" for t in finished.values()) + f" s (the slow one {finished[slow.me]:.2f} s)")
        passed = [f.passed_over for f in fetches]
        assert after.passed_over == {slow.me}, (passed, finished)
        # a cascade: a peer held up behind the slow one, then freed, passed over in its turn. The two-probe
        # rule kept the benchmark's runs free of it, but on a loaded CPU (the suite's other lane) it was seen
        # once here: at most one such, never of the peer that passed the slow one over, nobody slowed by it
        cascade = [f for f in fetches if f is not after and f.passed_over]
        assert len(cascade) <= 1 and all(f.passed_over != {after.me} and len(f.passed_over) == 1 for f in cascade), passed
        before = fetches[slow_place - 1].me if slow_place else None  # (None: the whole holders, the learner)
        assert after.upstream() == before
        assert sum(n for peer, n in after.received.items() if peer != slow.me) > 0.5 * size  # most of it came past the slow one
        if not last.passed_over:
            assert last.received[last.upstream()] > 0.8 * size
        # the slow one's own download bounds it (its link alone: size / SLOW_BYTES_S); the peers after
        # it, no longer behind it once judged (two probes, about a third of its chunks), end well before
        # it (behind it, they end with it: 1.0)
        assert max(finished[f.me] for f in fetches[slow_place + 1:]) < 0.75 * finished[slow.me], finished
        # one copy, or two when the slow one heads the chain: the learner sends it one at its pace, and one
        # to the peer that heads the chain now
        copies = 2.3 if slow_place == 0 else 1.3
        assert served < copies * size, f"the learner sent {served / size:.2f} copies"
    twice_on_a_loaded_machine(scenario)  # (with the other lane busy, 1 run in 5 left `after` behind the slow one)


@pytest.mark.parametrize("make_fabric", ["grpc"], indirect=True)
def test_the_peer_after_two_slow_downloads_side_by_side_walks_up_past_their_busy_answers_and_passes_both(make_fabric):
    """The second slow one never passes the first (its own download is as slow), so the last peer's
    upstream is slow and the peer before it no further ahead: every probe was answered busy, and it
    fetched at their pace to the end. Walking up on busy answers, it reaches the head, far ahead."""
    def scenario():
        # links half as fast as the other tests' (each slow one about 6.6 s): on a slow machine with the
        # other lane busy, the walk came too late to help at 80 KB/s in two runs of two
        fetches, finished, served, size = chain_of_four(make_fabric, slow_place=(1, 2), chunk=CHUNK // 4,
                                                        slow_bytes_s=SLOW_BYTES_S / 2)
        head, first, second, last = fetches
        print("finished after " + ", ".join(f"{t:.2f}" for t in finished.values()) + " s")
        assert last.passed_over == {first.me, second.me} and last.upstream() == head.me, [f.passed_over for f in fetches]
        assert not head.passed_over
        assert sum(n for peer, n in last.received.items() if peer == head.me) > 0.4 * size, last.received
        assert finished[last.me] < 0.8 * min(finished[first.me], finished[second.me]), finished
        assert served < 1.3 * size, f"the learner sent {served / size:.2f} copies"
    twice_on_a_loaded_machine(scenario, attempts=3)


@pytest.mark.parametrize("make_fabric", ["grpc"], indirect=True)
def test_on_equal_links_no_upstream_is_passed_over(make_fabric):
    fetches, _, served, size = chain_of_four(make_fabric, slow_place=None)
    assert not any(f.passed_over for f in fetches)
    assert all(f.received[f.upstream()] > 0.8 * size for f in fetches[1:])
    assert served < 1.3 * size


def test_a_freed_slot_goes_to_the_requester_holding_the_fewest():
    """A slow requester whose chunks take long to go out does not hold a holder's slots from a fast
    one: by the count given alone it was served as often, and the fast one went at its pace."""
    slots = UploadSlots(2)
    assert slots.take(0.0, "fast") and slots.take(0.0, "slow")
    order = []
    waiters = [threading.Thread(target=lambda who=who: slots.take(5.0, who) and order.append(who)) for who in ("slow", "fast")]
    for w in waiters:
        w.start()
        time.sleep(0.05)  # the slow one waits first, and was given no more than the fast one
    slots.release(1.0, "fast")  # the fast one's chunk is out: it holds none now, the slow one still one
    waiters[1].join(5)
    assert order == ["fast"]
    slots.release(1.0, "slow")
    waiters[0].join(5)
    assert order == ["fast", "slow"] and slots.active == 2


def test_probes_in_a_row_that_find_an_upstream_slow_pass_it_over_and_busy_answers_are_spaced_out_not_counted(monkeypatch):
    """Two probes in a row that find the upstream slow pass it over; one that does not, or is answered
    busy (the peer before does not hold the chunk yet: the upstream keeps up), starts the count afresh.
    Busy answers are not counted against PROBES: they came while a slow uplink further up held a whole
    chain back, used the probes up, and left the peers after a slow download at its pace. Instead each
    busy answer in a row doubles the chunks before the next probe."""
    assert PASSES == 2
    monkeypatch.setattr(upstream_pace, "PROBE_MIN_S", 0.02)  # (a throughput is reckoned over at least this long)

    def probe(pace, chunks=PROBE_AFTER_CHUNKS):
        for _ in range(chunks):
            time.sleep(0.011)
            pace.arrived("up", 1000)
        return pace.start_probe("up")

    pace = UpstreamPace()
    assert probe(pace, PROBE_AFTER_CHUNKS + 1) is not None and not pace.end_probe("up", True)
    assert probe(pace) is not None and pace.end_probe("up", True)  # the second in a row: passed over
    again = UpstreamPace()
    assert probe(again, PROBE_AFTER_CHUNKS + 1) is not None and not again.end_probe("up", True)
    assert probe(again) is not None and not again.end_probe("up", False, busy=True)  # the count starts afresh
    assert probe(again) is None  # two chunks after a busy answer: too soon
    assert probe(again, PROBE_AFTER_CHUNKS) is not None and not again.end_probe("up", False, busy=True)
    assert probe(again, 3 * PROBE_AFTER_CHUNKS) is None and probe(again, PROBE_AFTER_CHUNKS) is not None  # 8 after two
    again.end_probe("up", True)
    for _ in range(PROBES - 2):  # answers that came count against PROBES (two so far); busy ones did not
        assert probe(again) is not None
        again.end_probe("up", False)
    assert probe(again, 4 * PROBE_AFTER_CHUNKS) is None  # PROBES probes answered: no more


def test_probes_that_settle_nothing_walk_up_until_an_answer_finds_the_upstream_keeping_up(monkeypatch):
    """Two slow downloads side by side: the peer before the upstream answers busy, not holding the
    chunk, or sends it neither fast enough to pass the upstream over nor as slowly, or not in time
    (`unsure`). After WALK_AFTER_UNSURE such probes the probes ask the peer before it; one there that
    finds the upstream slow stays there (to pass both over), one that finds it keeping up (equal
    links) steps the probes back down, and unsure probes walk them no more. A probe that finds the
    upstream slow in between does not end the count. Busy answers for want of upload slots (a slow
    requester holds them) are not unsure."""
    monkeypatch.setattr(upstream_pace, "PROBE_MIN_S", 0.02)
    spaced = 16 * PROBE_AFTER_CHUNKS  # past any spacing after busy answers

    def probe(pace) -> bool:
        for _ in range(spaced):
            time.sleep(0.002)
            pace.arrived("up", 1000)
        return pace.start_probe("up") is not None

    def walked(pace) -> None:
        assert probe(pace) and not pace.end_probe("up", False, busy=True, unsure=True)  # not held yet
        assert probe(pace) and not pace.end_probe("up", True)  # held, and sent far faster than the upstream
        assert pace.further("up") == 0 and probe(pace)
        pace.end_probe("up", False, unsure=True)  # sent 2x as fast, say
        assert pace.further("up") == 0 and probe(pace)
        pace.end_probe("up", False, unsure=True)  # or not in time
        assert WALK_AFTER_UNSURE == 3 and pace.further("up") == 1

    out_of_slots = UpstreamPace()
    for _ in range(2 * WALK_AFTER_UNSURE):
        assert probe(out_of_slots)
        out_of_slots.end_probe("up", False, busy=True)
    assert out_of_slots.further("up") == 0
    healthy = UpstreamPace()
    walked(healthy)
    assert probe(healthy) and not healthy.end_probe("up", False, kept_up=True)  # the upstream keeps up with it
    assert healthy.further("up") == 0
    for _ in range(2 * WALK_AFTER_UNSURE):  # settled: busy answers are spaced out, and walk no more
        assert probe(healthy)
        healthy.end_probe("up", False, busy=True, unsure=True)
    assert healthy.further("up") == 0
    slow = UpstreamPace()
    walked(slow)
    assert probe(slow) and not slow.end_probe("up", True)
    assert probe(slow) and slow.end_probe("up", True) and slow.further("up") == 1  # passed over from there


class ScriptedChain:
    """A weight client for a chain's peer: each holder sends `data`'s chunks through a link of its own
    (SlowLink; None: at once); the bytes are the payload's, so every chunk verifies."""

    def __init__(self, data: bytes, spec, links: dict) -> None:
        self.data, self.spec, self.links = data, spec, links
        self.asked: dict[str, int] = {}

    def piece(self, holder, spec, index, wait_s=0.0, *, sink=None, **options):
        self.asked[holder] = self.asked.get(holder, 0) + 1
        start, end = spec.bounds(index)
        chunk = self.data[start:end]
        if self.links.get(holder) is not None:
            self.links[holder].carry(len(chunk))
        if sink is not None:
            sink(chunk)
        return chunk


def test_a_probe_that_finds_the_peer_before_slow_too_walks_up_and_passes_both_over():
    """A slow download right behind a slow uplink: the peer after them finds its upstream slow, and the
    peer before it just as slow (it holds the chunks far ahead, but sends them at its uplink's pace),
    so its next probes ask the peer before that one, which is fast: both slow peers are passed over
    at once. Before, such a peer kept its upstream, and every peer after them fetched at their pace."""
    from swarm.fabric.weights.chunks import ChunkBook, spec_of
    from swarm.fabric.weights.chunked_fetch import ChunkedFetch, ChunkSources
    from tests.fabric.weights.test_chunks import payload

    chunk = 1 << 14
    data = payload(48 * chunk)
    spec, manifest = spec_of("snapshot", 1, data, chunk)
    slow_upload, slow_download = SlowLink(100_000), SlowLink(100_000)  # each chunk in 0.16 s
    client = ScriptedChain(data, spec, {"Ccc": slow_download, "Bbb": slow_upload})
    fetch = ChunkedFetch(client, ChunkBook(lambda kind, version: None, chunk), spec,
                         ChunkSources(["Learner"], ["Aaa", "Bbb", "Ccc", "Me"]), "Me", unreachable=(ConnectionError,),
                         on_corrupt=lambda peer, exc: None, chain=True)
    fetch._manifest = lambda: (manifest, spec.digests(manifest, "x"))
    started = time.monotonic()
    assert fetch.run().payload() == data
    took = time.monotonic() - started
    assert fetch.passed_over == {"Bbb", "Ccc"} and fetch.upstream() == "Aaa", (fetch.passed_over, client.asked)
    assert fetch.received["Aaa"] > 0.5 * len(data), fetch.received  # the rest from the fast peer
    assert took < 0.6 * len(data) / 100_000, took  # behind the slow one throughout: 7.9 s
