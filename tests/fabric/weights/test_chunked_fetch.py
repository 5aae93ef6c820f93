"""A chunked fetch (swarm/fabric/weights/chunked_fetch.py) against real holders on loopback: a chain of
peers with one gone from its middle, peers whose stripe plans differ, a redirect to a peer that has
left (and the share of a payload one requester is sent to one taker for), a sharer this peer avoids, a chunk asked for the moment a fetch starts, a manifest asked for
already, who shares a payload out, the plans peers make, and a fetch whose holders all lack it. The chunks themselves and whole swarms sharing versions out: test_chunks.py."""

import threading
import time
from concurrent.futures import Future

import pytest

import swarm.fabric.weights.chunked_fetch as chunked_fetch
from swarm.fabric.weights.chunked_fetch import ChunkedFetch, ChunkedFetchFailed, ChunkSources
from swarm.fabric.weights.sharer_view import SharerView, sharers_for
from swarm.fabric.membership.link_judge import LinkJudge
from swarm.fabric.weights.chunked_fetch import WHOLE_WORKERS
from swarm.fabric.weights.chunks import DIGEST_BYTES, MAX_WAIT_S, ChunkBook, spec_of
from swarm.fabric.weights.takers import REDIRECT_SHARE
from swarm.fabric.membership.records import Heartbeat, Member
from swarm.fabric.weights.versions import VersionStore
from tests.fabric.weights.test_chunks import CHUNK, payload, versions
from tests.helpers.retries import twice_on_a_loaded_machine


def learner_with_a_snapshot(make_fabric):
    """A learner holding version 0 in CHUNK-sized chunks: (its fabric, its store, the snapshot's spec)."""
    learner = make_fabric()
    store = VersionStore()
    store.book.chunk_bytes = CHUNK
    v0, _ = versions()
    store.add(0, v0)
    return learner, store, next(s for s in store.chunk_specs(0) if s.kind == "snapshot")


def fetch_by(peer, book, spec, whole, sharers, on_corrupt=lambda p, e: None, **options):
    """A chunked fetch of `spec` by `peer` (a fabric) into `book`."""
    return ChunkedFetch(peer.weight_client(), book, spec, ChunkSources(whole, sharers), peer.peer_id,
                        unreachable=peer.unreachable_errors(), on_corrupt=on_corrupt, **options)


@pytest.mark.parametrize("make_fabric", ["hivemind", "grpc"], indirect=True)
def test_a_chain_passes_the_payload_along_and_closes_over_a_peer_gone_from_its_middle(make_fabric):
    """Four sharers make one chain in their sorted order; the second has left. The first takes the
    payload from the learner, the third from the first once the second failed it, the fourth from
    the third, each passing chunks on as they arrive: bit for bit, and one copy from the learner."""
    # (its asserts judge paces: a CPU stall on the shared cores can make the head look too slow to the
    # third, which then takes its chunks from the learner: by design, and a run of its own then)
    def scenario():
        learner, store, spec = learner_with_a_snapshot(make_fabric)
        server = learner.weight_server(store)
        peers = sorted((make_fabric() for _ in range(4)), key=lambda peer: peer.peer_id)
        sharers = [peer.peer_id for peer in peers]
        gone = peers.pop(1)
        gone.shutdown()
        stores = [VersionStore() for _ in peers]
        servers = [peer.weight_server(s) for peer, s in zip(peers, stores)]
        fetches = [fetch_by(peer, s.book, spec, [learner.peer_id], sharers) for peer, s in zip(peers, stores)]
        done = []
        threads = [threading.Thread(target=lambda f=f: done.append(f.run().payload())) for f in fetches]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert done == [store.payload("snapshot", 0)] * 3
            head, third, fourth = fetches
            assert all(f.chain for f in fetches) and head.upstream() is None and fourth.upstream() == third.me
            assert gone.peer_id in third._dead and third.upstream() == head.me  # passed over, after 2 failures
            # the third's chunks asked of the gone peer came from whole holders: the learner sent them
            # to the head (or, when the third asked first, sent the head to the third for those)
            assert head.received[learner.peer_id] > 0.8 * spec.size
            # (a share unless a CPU stall made the one before look far slower and it was passed over: by design)
            assert third.received[head.me] > 0.8 * spec.size or head.me in third.passed_over
            assert fourth.received[third.me] > 0.8 * spec.size or third.me in fourth.passed_over  # the rest: redirects while the third recovered
            time.sleep(0.2)  # the learner counts a chunk's bytes once it has sent them
            assert server.bytes_served < 1.3 * spec.size, f"the learner sent {server.bytes_served / spec.size:.2f} copies"
        finally:
            for f in fetches:
                f.client.close()
            for s in [server, *servers]:
                s.close()

    twice_on_a_loaded_machine(scenario)


@pytest.mark.parametrize("make_fabric", ["hivemind", "grpc"], indirect=True)
def test_peers_that_each_take_the_other_for_a_chunks_owner_fetch_it_instead_of_waiting(make_fabric, monkeypatch):
    """Records seen a heartbeat apart can give two peers mirrored stripe plans: each waits for the
    other to have its odd chunks. A peer asked for a chunk it is not fetching fetches it next
    (`_adopt`), so neither waits out OWNER_WAIT_S (made a minute here: the test would time out)."""
    import swarm.fabric.weights.chunked_fetch as chunked_fetch

    monkeypatch.setattr(chunked_fetch, "OWNER_WAIT_S", 60.0)
    learner, store, spec = learner_with_a_snapshot(make_fabric)
    servers = [learner.weight_server(store)]
    peers = [make_fabric(), make_fabric()]
    stores = [VersionStore() for _ in peers]
    servers += [peer.weight_server(s) for peer, s in zip(peers, stores)]
    a, b = (peer.peer_id for peer in peers)
    plans = {a: [a, b], b: [b, a]}  # chunk 1, 3, ...: a thinks b owns it, b thinks a does
    fetches = [fetch_by(peer, s.book, spec, [learner.peer_id], plans[peer.peer_id], chain=False)
               for peer, s in zip(peers, stores)]
    done = []
    threads = [threading.Thread(target=lambda f=f: done.append((f.run().payload(), time.monotonic()))) for f in fetches]
    started = time.monotonic()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(done) == 2
        assert done[0][0] == done[1][0] == store.payload("snapshot", 0)
        # a holder waits at most MAX_WAIT_S for a chunk before it says "not held" (then the fetch
        # falls back to whole holders): neither fetch came to that
        assert max(t for _, t in done) - started < MAX_WAIT_S, "a fetch waited for its mirror image"
        assert all(f.adopted > 0 for f in fetches)
        # both take every even chunk for their own and ask the learner for it; it sends each chunk
        # to the first, the second to it: about one copy (two requests may cross in flight), not two
        size = spec.size
        assert sum(f.redirected for f in fetches) > spec.count // 4
        assert servers[0].bytes_served < 1.3 * size, (
            f"the learner sent {servers[0].bytes_served / size:.2f} copies; redirected "
            f"{[f.redirected for f in fetches]}, failures {[dict(f._failures) for f in fetches]}, "
            f"misses {[dict(f._misses) for f in fetches]}, busy {[dict(f._busy_answers) for f in fetches]}")
    finally:
        for f in fetches:
            f.client.close()
        for server in servers:
            server.close()


@pytest.mark.parametrize("make_fabric", ["hivemind", "grpc"], indirect=True)
def test_a_peer_redirected_to_a_taker_that_is_gone_gets_the_chunks_from_the_holder_all_the_same(make_fabric):
    """The learner sent every chunk to a relaying peer that has left since: a later fetch is
    redirected to it for each chunk, finds it gone, and asks the learner again with `force`; the
    version arrives whole, and the gone peer is asked once, not once per chunk."""
    learner, store, spec = learner_with_a_snapshot(make_fabric)
    server = learner.weight_server(store)
    gone, late = make_fabric(), make_fabric()
    servers = [gone.weight_server(VersionStore()), late.weight_server(VersionStore())]

    def fetch(peer):
        return fetch_by(peer, VersionStore().book, spec, [learner.peer_id], [peer.peer_id])

    try:
        first = fetch(gone)
        assert first.run().payload() == store.payload("snapshot", 0) and first.redirected == 0
        first.client.close()
        servers[0].close()
        gone.shutdown()
        second = fetch(late)
        assert second.run().payload() == store.payload("snapshot", 0)
        # every chunk's first request, up to the requester's share of one taker (the rest is sent at once)
        assert second.redirected == int(spec.count * REDIRECT_SHARE) == store.book.takers.redirected
        assert store.book.takers.capped >= spec.count - second.redirected - WHOLE_WORKERS  # (the first ones: forced)
        # the gone peer is passed over at its second failure (SHARER_FAILURES), the requests in
        # flight then (2 workers) failing too: a few requests in all, not one per chunk
        assert gone.peer_id in second._dead and 2 <= second._failures[gone.peer_id] <= 3
        assert set(second.received) == {learner.peer_id}
        assert 1.9 * spec.size < server.bytes_served < 2.1 * spec.size  # one copy each, nothing twice
        second.client.close()
    finally:
        for s in [server, *servers]:
            s.close()


@pytest.mark.parametrize("make_fabric", ["grpc"], indirect=True)
def test_a_sharer_this_peer_avoids_keeps_its_stripe_and_is_never_asked(make_fabric):
    """A peer shuns a sharer that sent it corrupt data, yet deals the stripes out among all the
    sharers as the others do (dropping it would move nearly every chunk to another owner in this
    plan alone): the avoided sharer's chunks come from whole holders, and it is not asked."""
    learner, store, spec = learner_with_a_snapshot(make_fabric)
    server = learner.weight_server(store)
    me, avoided = make_fabric(), make_fabric()
    servers = [me.weight_server(VersionStore()), avoided.weight_server(VersionStore())]  # it would hold a request ~8 s
    sharers = sorted([me.peer_id, avoided.peer_id])
    fetch = ChunkedFetch(me.weight_client(), VersionStore().book, spec,
                         ChunkSources([learner.peer_id], sharers, frozenset({avoided.peer_id})), me.peer_id,
                         unreachable=me.unreachable_errors(), on_corrupt=lambda p, e: None, chain=False)
    try:
        assert {fetch.owner(i) for i in range(spec.count)} == set(sharers)  # the plan every sharer makes
        assert fetch.run().payload() == store.payload("snapshot", 0)
        assert set(fetch.received) == {learner.peer_id}
        assert fetch._misses[avoided.peer_id] == fetch._busy_answers[avoided.peer_id] == 0  # never asked
        assert fetch._failures[avoided.peer_id] == 0
        fetch.client.close()
    finally:
        for s in [server, *servers]:
            s.close()


@pytest.mark.parametrize("make_fabric", ["grpc"], indirect=True)
def test_a_chunk_asked_for_the_moment_a_fetch_starts_serving_is_fetched_once(make_fabric, monkeypatch):
    """A peer may ask for a chunk as soon as this one serves its partial payload (`begin`), before
    its workers start. Adopting that chunk must not queue it twice: two workers would fetch it at
    once, and the learner would send it twice."""
    learner, store, spec = learner_with_a_snapshot(make_fabric)
    server = learner.weight_server(store)
    peer = make_fabric()
    book = VersionStore().book
    begin = book.begin

    def begin_and_get_asked(*args, **kwargs):
        partial = begin(*args, **kwargs)
        for index in (0, spec.count - 1):  # as the weight server does for a request for a missing chunk
            partial.wanted(index)
        return partial

    monkeypatch.setattr(book, "begin", begin_and_get_asked)
    fetch = fetch_by(peer, book, spec, [learner.peer_id], [peer.peer_id])
    try:
        assert fetch.run().payload() == store.payload("snapshot", 0)
        assert fetch.adopted == 0  # its own stripe: queued already
        time.sleep(0.2)  # the learner counts a chunk's bytes once it has sent them
        assert server.bytes_served == spec.size + spec.count * DIGEST_BYTES  # every chunk once, and the manifest
        fetch.client.close()
    finally:
        server.close()


@pytest.mark.parametrize("make_fabric", ["grpc"], indirect=True)
def test_a_manifest_asked_for_already_is_used_and_a_failed_one_asked_again(make_fabric):
    """The follower asks the learner for the manifest while it looks the members up: the fetch uses
    that answer (the learner is not asked again) and asks again when it failed; one that does not
    match the root strikes the learner, as any holder's would."""
    learner, store, spec = learner_with_a_snapshot(make_fabric)
    server = learner.weight_server(store)
    peer = make_fabric()
    manifest = spec_of(spec.kind, spec.version, store.payload("snapshot", 0), spec.chunk_bytes)[1]

    def answered(value=None, error=None) -> Future:
        future = Future()
        future.set_result(value) if error is None else future.set_exception(error)
        return future

    def learner_bytes_for_a_fetch(answer: Future, on_corrupt=lambda p, e: None) -> int:
        before = server.bytes_served
        fetch = fetch_by(peer, VersionStore().book, spec, [learner.peer_id], [peer.peer_id], manifest=answer,
                         on_corrupt=on_corrupt)
        try:
            assert fetch.run().payload() == store.payload("snapshot", 0)
        finally:
            fetch.client.close()
        time.sleep(0.2)  # the learner counts bytes once it has sent them
        return server.bytes_served - before

    struck = []
    try:
        assert learner_bytes_for_a_fetch(answered(manifest)) == spec.size  # the chunks, not the manifest again
        assert learner_bytes_for_a_fetch(answered(error=KeyError("not held"))) == spec.size + spec.count * DIGEST_BYTES
        with pytest.raises(ChunkedFetchFailed, match="manifest"):  # it does not match the root: struck
            learner_bytes_for_a_fetch(answered(manifest[:-1] + b"x"), lambda p, e: struck.append(p))
        assert struck == [learner.peer_id]  # and not asked again: no other holder, so the fetch fails
    finally:
        server.close()


def member(peer_id: str, holds=(), relay=True, role="sampler", fetch=None) -> Member:
    """A member's record; `fetch`: its last fetch, (version, bytes, transfer seconds)."""
    reported = {} if fetch is None else {"fetch_version": fetch[0], "fetch_bytes": fetch[1], "fetch_s": fetch[2] + 1.0,
                                         "fetch_transfer_s": fetch[2]}
    beat = Heartbeat(role=role, holds=tuple(holds), relay=relay, **reported)
    return Member(record=beat.record(peer_id, 0.0), expires_at=1e12, owner=peer_id.encode())


def test_sharers_are_the_relaying_samplers_about_to_fetch_the_same_payload():
    delta, _ = spec_of("delta", 5, payload(5000), CHUNK)
    snapshot, _ = spec_of("snapshot", 5, payload(5000), CHUNK)
    members = [member("a", [3, 4]), member("b", [4]), member("c", [4, 5]), member("d", [3]), member("e", []),
               member("f", [4], relay=False), member("L", [4, 5], role="learner")]
    assert sharers_for(delta, members, me="me", me_relays=True) == ["a", "b", "me"]
    assert sharers_for(delta, members, me="me", me_relays=False) == ["a", "b"]
    assert sharers_for(snapshot, members, me="me", me_relays=True) == ["e", "me"]


def test_each_peer_asks_the_owners_in_turn_from_the_one_after_it_so_no_owner_is_crowded():
    spec, _ = spec_of("delta", 1, payload(8 * CHUNK), CHUNK)
    sharers = ["a", "b", "c", "d"]
    orders = {}
    for me in sharers:
        fetch = ChunkedFetch(NothingHeld(), ChunkBook(lambda kind, version: None, CHUNK), spec,
                             ChunkSources(["learner"], sharers), me, unreachable=(), on_corrupt=lambda peer, exc: None,
                             chain=False)
        orders[me] = [fetch.owner(i) for i in sorted(range(spec.count), key=fetch.turn) if fetch.owner(i) != me]
    assert orders["b"] == ["c", "d", "a"] * 2  # a stripe arrives at its owner in order: round by round
    for step in range(3):  # at every step of a round the four peers ask four different owners
        assert len({orders[me][step] for me in sharers}) == 4
    outsider = ChunkedFetch(NothingHeld(), ChunkBook(lambda kind, version: None, CHUNK), spec,
                            ChunkSources(["learner"], sharers), "e", unreachable=(), on_corrupt=lambda peer, exc: None)
    assert sorted(range(spec.count), key=outsider.turn)[:4] in ([0, 1, 2, 3], [1, 2, 3, 0], [2, 3, 0, 1], [3, 0, 1, 2])


def test_up_to_chain_max_sharers_make_a_chain_in_their_sorted_order_and_more_make_stripes():
    spec, _ = spec_of("delta", 1, payload(8 * CHUNK), CHUNK)
    sharers = ["a", "b", "c", "d"]

    def plan(me, sharers=sharers, dead=(), avoid=frozenset()):
        fetch = ChunkedFetch(NothingHeld(), ChunkBook(lambda kind, version: None, CHUNK), spec,
                             ChunkSources(["learner"], sharers, avoid), me, unreachable=(),
                             on_corrupt=lambda peer, exc: None)
        fetch._dead.update(dead)
        return fetch

    head, third = plan("a"), plan("c")
    assert head.chain and third.chain
    assert {head.owner(i) for i in range(spec.count)} == {"a"}  # from whole holders, with a lone fetcher's workers
    assert head.whole_workers == chunked_fetch.WHOLE_WORKERS > third.whole_workers
    assert {third.owner(i) for i in range(spec.count)} == {"b"}
    assert sorted(range(spec.count), key=third.turn) == list(range(spec.count))  # in order, as "b" receives them
    assert plan("c", dead={"b"}).owner(0) == "a" and plan("c", dead={"a", "b"}).owner(0) == "c"
    avoiding = plan("c", avoid=frozenset({"a", "b"}))
    assert avoiding.upstream() is None and avoiding.whole_workers == chunked_fetch.WHOLE_WORKERS  # heads it
    outsider = plan("e")  # not sharing (it does not relay): each chunk from its stripe's owner, all of whom get it
    assert not outsider.chain and {outsider.owner(i) for i in range(4)} == set(sharers)
    many = [f"p{i:02d}" for i in range(chunked_fetch.CHAIN_MAX + 1)]
    assert not plan("p03", many).chain and {plan("p03", many).owner(i) for i in range(len(many))} == set(many)
    assert plan("a", ["a"]).chain is False  # alone: no one to pass it to


class NothingHeld:
    """A weight client whose every holder answers "not held"."""

    def piece(self, holder, spec, index, wait_s=0.0, **flags):
        raise KeyError(f"{holder} holds nothing")


def test_a_fetch_whose_holders_all_lack_the_payload_fails_at_once_rather_than_spinning():
    data = payload(4 * CHUNK)
    spec, manifest = spec_of("snapshot", 3, data, CHUNK)
    book = ChunkBook(lambda kind, version: None, CHUNK)
    fetch = ChunkedFetch(NothingHeld(), book, spec, ChunkSources(["relay", "learner"], ["me"]), "me",
                         unreachable=(ConnectionError,), on_corrupt=lambda peer, exc: None)
    fetch._manifest = lambda: (manifest, spec.digests(manifest, "x"))  # the manifest came; then every holder lost it
    started = time.monotonic()
    with pytest.raises(ChunkedFetchFailed, match="whole holders left: 0 of 2"):
        fetch.run()
    assert time.monotonic() - started < 3
    assert book.lookup("snapshot", 3, spec.root, None, 0.0) is None  # the partial is no longer served


def test_a_sampler_is_judged_slow_by_its_own_drop_not_by_fetching_behind_a_slow_one():
    judge = LinkJudge()
    mib = 8 << 20
    # version 5's chain: a and b fetched fast, s dropped, v1 and v2 behind it fetched as slowly
    judge.named(5, ["a", "b", "s", "v1", "v2"])
    judge.heard([member(p, [5], fetch=(5, mib, secs)) for p, secs in
                 (("a", 1.0), ("b", 1.05), ("s", 4.4), ("v1", 4.6), ("v2", 4.5))])
    assert set(judge.slow()) == {"s"}
    orders = [judge.order(["v2", "s", "b", "v1", "a"], version) for version in range(6, 14)]
    assert all(order[-1] == "s" for order in orders)  # last: it holds up nobody
    assert len({tuple(order) for order in orders}) > 1  # the others in an order drawn anew by version
    assert judge.order(["a", "b"], 9) == judge.order(["b", "a"], 9)
    # a slow head shows no drop along its chain; against the median of the others' best rates lately it does
    judge.named(6, ["s", "v1", "a"])
    judge.heard([member(p, [6], fetch=(6, mib, 4.5)) for p in ("s", "v1", "a")])
    assert set(judge.slow()) == {"s"}
    fresh = LinkJudge()  # ...unless none was ever faster: then it is not judged (yet)
    fresh.named(6, ["s", "v1", "a"])
    fresh.heard([member(p, [6], fetch=(6, mib, 4.5)) for p in ("s", "v1", "a")])
    assert fresh.slow() == {}
    fresh.heard([member("liar", [5], fetch=(5, mib, 1e-6))])  # one huge claim is not the median
    assert fresh.slow() == {}
    # no rate known (small payloads): sorted, as samplers sort their own
    assert LinkJudge().order(["b", "a", "b"], 7) == ["a", "b"]
    small = LinkJudge()
    small.heard([member("a", [1], fetch=(1, 1000, 0.01))])
    assert small.order(["b", "a"], 7) == ["a", "b"]


def chain_rates(chain: list[str], down: dict[str, float], up: dict[str, float], learner_up: float) -> dict[str, float]:
    """Each sampler's rate along a chain: no faster than its download, than its feeder's upload, or
    than its feeder's own rate (a sampler forwards what it has)."""
    rates, feeder_up, ahead = {}, learner_up, learner_up
    for peer in chain:
        ahead = rates[peer] = min(down[peer], feeder_up, ahead)
        feeder_up = up[peer]
    return rates


def test_a_slow_uplink_is_found_by_the_drops_behind_it_and_put_last_and_a_slow_download_before_it():
    mib, fast, slow = 8 << 20, 12 << 20, 2 << 20
    peers = ["a", "b", "c", "d", "e", "s", "u"]  # s: a slow line both ways; u: fast down, slow up
    down = {p: fast for p in peers} | {"s": slow}
    up = {p: fast for p in peers} | {"s": slow, "u": slow}
    judge, paced = LinkJudge(), []
    for version in range(5, 13):
        chain = judge.order(peers, version)
        if version == 5:  # the first chain: u before the end, so someone fetches behind it
            chain = ["a", "b", "c", "d", "u", "e", "s"]
        judge.named(version, chain)
        rates = chain_rates(chain, down, up, fast)
        judge.heard([member(p, [version], fetch=(version, mib, mib / rate)) for p, rate in rates.items()])
        # (u, last, fetches at s's pace: the price of putting nobody behind it)
        paced.append(all(rate == fast for p, rate in rates.items() if p not in ("s", "u")))
    # the first drop behind u is blamed on e, which had it (nothing says e's download keeps up);
    # the next, of a sampler that fetched at full pace before, on u; e's, once e fetches at full pace
    assert judge.slow_uplinks() == {"u"} and set(judge.slow()) == {"s"}
    assert judge.order(peers, 13)[-2:] == ["s", "u"]
    assert paced[-3:] == [True] * 3  # from then on every other sampler fetches at full pace
    assert not paced[0]
    # a head that dropped while keeping up elsewhere dropped for the learner's sake: nobody is judged
    judge.named(13, ["a", "b"])
    judge.heard([member(p, [13], fetch=(13, mib, mib / slow)) for p in ("a", "b")])
    assert judge.slow_uplinks() == {"u"} and set(judge.slow()) == {"s"}


class ListedFabric:
    """What a learner's SharerView reads of its fabric: its peer id and the members' records."""

    peer_id = "L"

    def __init__(self) -> None:
        self.listed = []

    def members(self):
        return self.listed


def test_the_learner_names_a_deltas_chain_with_a_sampler_judged_slow_last():
    peers = ["a", "b", "s", "v"]
    fabric, view = ListedFabric(), None

    def delta(version):
        return spec_of("delta", version, payload(5000), CHUNK)[0]

    try:
        view = SharerView(fabric)
        fabric.listed = [member(p, [4]) for p in reversed(peers)]  # no fetches reported yet
        view.publishing(5)
        assert view.announced(5, [delta(5)]) == peers  # sorted: a, b, s, v
        # they fetched version 5 along that chain (8 MiB each): s slowly, v behind it as slowly
        seconds = {"a": 1.0, "b": 1.1, "s": 4.5, "v": 4.6}
        fabric.listed = [member(p, [5], fetch=(5, 8 << 20, seconds[p])) for p in peers]
        view.publishing(6)
        named = view.announced(6, [delta(6)])
        assert named[-1] == "s" and sorted(named) == peers
        assert view.announced(6, [delta(6)]) == named  # the same list at every announcement of a version
    finally:
        if view is not None:
            view.close()
