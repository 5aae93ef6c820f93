"""Policy versions: how they are encoded, held, announced, cut into chunks and fetched.

- delta.py            - versions as bit-exact snapshots and deltas; varints.py, the varint and zigzag
                        coding its streams use; value_classes.py, the classes its changes are counted
                        in; packed_stream.py, its streams fed to zlib in pieces; wire_layout.py, a
                        payload's outer layout (codec byte, format check, compressed segments).
- versions.py         - the store of versions a peer holds and the client logic that rebuilds fetched ones.
- announcements.py    - `VersionAnnouncement` (and the run's sampling settings it carries), and which
                        announcements to trust.
- announcement_push.py - a learner's announcement pushed straight to the samplers it names.
- chunks.py, chunked_fetch.py - a version's payload in verifiable chunks, served while it arrives,
                        and fetched along a chain (or in stripes) shared with the peers fetching it too;
                        sharer_view.py, who fetches a payload now (the learner names a delta's chain);
                        upstream_pace.py, a chain's slow upstream passed over; source_judging.py,
                        relays and redirect targets judged by their delivery rate; takers.py, a
                        chunk sent once by a whole holder, its later requesters sent to its taker.
- upload_slots.py     - how many transfers a holder serves at once, and who gets a freed slot.
- follower.py         - a sampler's background fetching of new versions (other holders first, the
                        learner last) and the latency simulation's choice of version.
"""
