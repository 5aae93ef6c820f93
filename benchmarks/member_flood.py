"""What reading a run's membership costs, and what it still finds, under a flood of member records.

A bootstrap DHT node, an honest learner (its record, in its own learner directory, and an
announcement) and HONEST_SAMPLERS relaying samplers; then a real attacker node
(tests/helpers/member_flood.py) sends 10,000 records signed by one key under as many texts of it,
and one well-formed record for each of FLOOD_KEYS throwaway 2048-bit RSA keys (env
GEPO_MEMBER_FLOOD_KEYS, default 10,000: what the store takes, since each key owns one record). Measured before (baseline)
and after the flood, in the same process: seconds and bytes of one listing (`list_members`), how
many honest samplers it shows, whether the learner is found from the run's key
(`authorised_learners`) and the version read from its announcements (`latest_announced`).

`python -m benchmarks member_flood`
"""

from __future__ import annotations

import os
import pickle
import time

from benchmarks.common import markdown_table, write_result

HONEST_SAMPLERS = 4
ONE_KEY_RECORDS = 10_000
RUN_ID = "bench-members"
READS = 3


def _measure(observer, owner: bytes, honest: set[str]) -> dict:
    from swarm.fabric.hivemind.records import authorised_learners, latest_announced, list_members

    seconds, sizes, shown = [], [], []
    for _ in range(READS):
        started = time.perf_counter()
        members = list_members(observer, RUN_ID)
        seconds.append(time.perf_counter() - started)
        sizes.append(len(pickle.dumps(members)))
        shown.append(sum(m.record.peer_id in honest for m in members))
    learners = authorised_learners(observer, RUN_ID, [owner])
    announced = latest_announced(observer, RUN_ID, [owner])
    return {"list_s": sorted(seconds)[READS // 2], "listed": len(members), "list_bytes": max(sizes),
            "honest_samplers_shown": min(shown), "learner_found": [m.record.peer_id for m in learners] == ["learner"],
            "version": None if announced is None else announced.version}


def run() -> None:
    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    from swarm.fabric.hivemind.dht import start_dht
    from swarm.fabric.hivemind.records import MAX_LISTED_PER_PAGE, MembershipPublisher, store_announcement
    from swarm.fabric.membership.records import MEMBER_PAGES, Heartbeat
    from swarm.fabric.weights.announcements import RunSampling, VersionAnnouncement
    from tests.helpers.member_flood import flood

    keys = int(os.environ.get("GEPO_MEMBER_FLOOD_KEYS", "10000"))
    load = os.getloadavg()[0]
    boot, _ = start_dht(RUN_ID)
    addr = [str(a) for a in boot.get_visible_maddrs()]
    nodes = []
    try:
        owner_key = RSAPrivateKey()
        learner, validator = start_dht(RUN_ID, initial_peers=addr, signing_key=owner_key)
        nodes.append(learner)
        owner = validator.local_public_key
        publishers = [MembershipPublisher(learner, RUN_ID, owner, heartbeat_s=600.0)]
        beats = [Heartbeat(role="learner", version=3)]
        for i in range(HONEST_SAMPLERS):
            node, v = start_dht(RUN_ID, initial_peers=addr)
            nodes.append(node)
            publishers.append(MembershipPublisher(node, RUN_ID, v.local_public_key, heartbeat_s=600.0))
            beats.append(Heartbeat(role="sampler", version=3, relay=True))

        def beat_all() -> None:  # records expire after a few heartbeats: as honest peers, renew them
            for i, (publisher, beat) in enumerate(zip(publishers, beats)):
                node = publisher.dht
                record = beat.record("learner" if i == 0 else f"sampler-{i}", get_dht_time()).dict()
                node.store(publisher.key, subkey=publisher.subkey, value=record, expiration_time=get_dht_time() + 1800)
                if beat.role == "learner":
                    from swarm.fabric.hivemind.records import directory_key

                    node.store(directory_key(RUN_ID, "learners", owner), subkey=owner, value=record,
                               expiration_time=get_dht_time() + 1800)
            ann = VersionAnnouncement.of(RUN_ID, 3, "0" * 64, "learner", get_dht_time(), RunSampling())
            store_announcement(learner, owner, ann, expiry_s=1800)

        honest = {f"sampler-{i}" for i in range(1, HONEST_SAMPLERS + 1)}
        beat_all()
        baseline = _measure(boot, owner, honest)
        attacker, _ = start_dht(RUN_ID, initial_peers=addr)
        nodes.append(attacker)
        started = time.time()
        taken = flood(attacker, boot.peer_id.to_base58(), RUN_ID, one_key=ONE_KEY_RECORDS, throwaway=keys, owner=owner)
        flood_s = time.time() - started
        beat_all()
        flooded = _measure(boot, owner, honest)
    finally:
        for node in nodes:
            node.shutdown()
        boot.shutdown()
    figures = {"one_key_records": ONE_KEY_RECORDS, "throwaway_keys": keys, "taken": taken, "flood_s": round(flood_s, 1),
               "baseline": baseline, "flooded": flooded, "bound_listed": MEMBER_PAGES * MAX_LISTED_PER_PAGE,
               "list_s_ratio": flooded["list_s"] / max(baseline["list_s"], 1e-9),
               "list_bytes_ratio": flooded["list_bytes"] / max(baseline["list_bytes"], 1),
               "load_average_at_start": load, "busy": load > (os.cpu_count() or 1)}
    rows = [[name, f["listed"], f["list_bytes"], f["list_s"], f["honest_samplers_shown"], f["learner_found"], f["version"]]
            for name, f in (("baseline", baseline), ("flooded", flooded))]
    markdown = (f"# member_flood\n\n{ONE_KEY_RECORDS} records of one key (taken: {taken.get('one_key')}), {keys} throwaway "
                f"keys (records taken: {taken.get('pages')}; into the owner's learner / version directories: "
                f"{taken.get('learners')} / {taken.get('versions')}); listing bounded at {MEMBER_PAGES * MAX_LISTED_PER_PAGE}."
                f"{' The machine was busy (load average %.1f): read the ratios, not the seconds.' % load if figures['busy'] else ''}\n\n"
                + markdown_table(["run", "listed", "bytes", "list s", f"honest samplers shown (of {HONEST_SAMPLERS})",
                                  "learner found by key", "version read"], rows)
                + f"\nlisting time x{figures['list_s_ratio']:.2f}, bytes x{figures['list_bytes_ratio']:.1f} against the baseline.\n")
    write_result("member_flood", figures, markdown)
