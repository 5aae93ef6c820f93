"""A learner's certificate made in the test process, as `swarm learner-key` and `swarm authorize`
make it (tests/cli/test_certificates.py runs those commands themselves): two CLI starts fewer, of
about 4 CPU s each, on a multi-learner test's path."""

from pathlib import Path


def certificate(identity_dir: Path, signer_key_file, run_id: str = "swarm") -> str:
    """The token `signer_key_file`'s owner signs for the learner key in `identity_dir` (made there if new)."""
    from swarm.fabric.membership.authority import issue
    from swarm.fabric.membership.identity import first_learner_key_file, load_existing_signing_key, load_or_create_signing_key
    from swarm.fabric.signing import owner_key

    learner = load_or_create_signing_key(first_learner_key_file(identity_dir))
    return issue(load_existing_signing_key(Path(signer_key_file)), run_id, owner_key(learner)).token
