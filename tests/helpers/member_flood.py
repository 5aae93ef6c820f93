"""A hostile DHT peer built from the project's own fabric code: it joins a run's swarm as any peer
does (swarm.fabric.hivemind.dht.start_dht) and then sends store requests straight to a chosen
node, signed correctly, bypassing its own node's checks, as a modified client would.

- `one_key_records`: thousands of membership records signed by one key, each under another text
  of that key (a comment appended, text around the `[owner:...]` marker), over every page.
- `throwaway_records`: one well-formed record per throwaway key (a fresh RSA key each), plus its
  tries to write into the run owner's learner and version directories.
"""

from __future__ import annotations

import dataclasses
from functools import partial

from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

from swarm.fabric.hivemind.records import directory_key
from swarm.fabric.membership.records import MEMBER_PAGES, Heartbeat, member_page_key, members_key
from swarm.fabric.signing import owner_key
from swarm.fabric.weights.announcements import RunSampling, VersionAnnouncement

SQUATTED_VERSION = 999_999  # what the flood's learner records and announcements claim
LIFETIME_S = 3000.0  # how long the flood's records last: the whole test (a node takes up to an hour ahead)


def throwaway_key(bits: int = 2048) -> RSAPrivateKey:
    """A fresh RSA key, of the size peers' keys have (hivemind's RSAPrivateKey makes 2048 bits)."""
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = rsa.generate_private_key(public_exponent=65537, key_size=bits)
    return key


def signed(private_key, key: str, subkey: bytes, value: dict, expiration: float) -> tuple:
    """A raw store request entry, signed as hivemind's RSASignatureValidator signs (whatever the subkey's text)."""
    key_id = DHTID.generate(source=key)
    value_bytes = MSGPackSerializer.dumps(value)
    record = DHTRecord(key=key_id.to_bytes(), subkey=MSGPackSerializer.dumps(subkey), value=value_bytes, expiration_time=expiration)
    signature = private_key.sign(MSGPackSerializer.dumps(dataclasses.astuple(record)))
    return key_id, subkey, value_bytes + b"[signature:" + signature + b"]", expiration


def squatter_record(peer_id: str, now: float) -> dict:
    return Heartbeat(role="learner", version=SQUATTED_VERSION, relay=True, holds=(SQUATTED_VERSION,)).record(peer_id, now).dict()


def one_key_records(run_id: str, key: RSAPrivateKey, count: int, now: float) -> list[tuple]:
    """`count` membership records of one key, each under another text of it, spread over the pages."""
    canonical = owner_key(key)
    inside = canonical[len(b"[owner:"):-1]
    out = []
    for i in range(count):
        kind = i % 3
        subkey = (b"[owner:" + inside + b" c%d]" % i if kind == 0 else
                  b"x%d" % i + canonical if kind == 1 else canonical + b"y%d" % i)
        out.append(signed(key, member_page_key(run_id, i % MEMBER_PAGES), subkey, squatter_record(f"squat-{i}", now), now + LIFETIME_S))
    return out


def throwaway_records(run_id: str, keys: list, owner: bytes, now: float) -> dict[str, list[tuple]]:
    """Per throwaway key: its own membership record in its page (well-formed: a store a node must
    take), a learner record in the run owner's learner directory and an announcement in its version
    directory (neither certified: to be refused)."""
    pages, learners, versions = [], [], []
    for i, key in enumerate(keys):
        subkey = owner_key(key)
        value = squatter_record(f"throwaway-{i}", now)
        pages.append(signed(key, members_key(run_id, subkey), subkey, value, now + LIFETIME_S))
        learners.append(signed(key, directory_key(run_id, "learners", owner), subkey, value, now + LIFETIME_S))
        ann = VersionAnnouncement.of(run_id, SQUATTED_VERSION, "0" * 64, f"throwaway-{i}", now, RunSampling()).dict()
        versions.append(signed(key, directory_key(run_id, "versions", owner), subkey, ann, now + LIFETIME_S))
    return {"pages": pages, "learners": learners, "versions": versions}


async def _store(node, target, entries: list, batch: int) -> int:
    accepted = 0
    for start in range(0, len(entries), batch):
        keys, subkeys, values, expirations = zip(*entries[start:start + batch])
        ok = await node.protocol.call_store(target, list(keys), list(values), list(expirations), subkeys=list(subkeys))
        accepted += sum(ok) if ok is not None else 0
    return accepted


async def _flood(_dht, node, peer: str, run_id: str, one_key: int, throwaway: int, owner: bytes, batch: int) -> dict:
    """In the attacker's DHT process (records are made there: hivemind's pipe to it takes small
    messages only): the one-key flood, then the throwaway-key flood; what the node `peer` took."""
    from hivemind.p2p import PeerID
    from hivemind.utils import get_dht_time

    target, now, taken = PeerID.from_base58(peer), get_dht_time(), {}
    if one_key:
        taken["one_key"] = await _store(node, target, one_key_records(run_id, throwaway_key(), one_key, now), batch)
    if throwaway:
        flood = throwaway_records(run_id, [throwaway_key() for _ in range(throwaway)], owner, get_dht_time())
        for kind, entries in flood.items():
            taken[kind] = await _store(node, target, entries, batch)
    return taken


def flood(dht, peer: str, run_id: str, *, one_key: int = 0, throwaway: int = 0, owner: bytes = b"", batch: int = 200) -> dict:
    """Send the node `peer` (base58 peer id) `one_key` records of one key and `throwaway` keys' records
    (see the module's docstring), in store requests of `batch`: {kind: records it took}."""
    return dht.run_coroutine(partial(_flood, peer=peer, run_id=run_id, one_key=one_key, throwaway=throwaway, owner=owner,
                                     batch=batch))
