"""What to say about a setting a role does not take: the close names it may have meant
(difflib), and the role it belongs to instead. Config files and the command line both use this."""

from __future__ import annotations

import difflib

from swarm.config.base import field_names
from swarm.config.roles import CONFIGS

# Settings of the whole run that the learner announces with every version; samplers sample as it says.
RUN_WIDE = ("temperature", "top_k", "top_p", "max_completion_length", "max_new_tokens")
# The roles in the order a hint names them: the peers of a swarm first.
HINT_ORDER = ("learner", "sampler", "bootstrap", "eval", "demo")


def roles_taking(key: str) -> list[str]:
    """The roles whose config has `key` (a field name or an alias), peers first."""
    return [role for role in HINT_ORDER if key in field_names(CONFIGS[role])]


def belongs_elsewhere(key: str, role: str, *, spelled: str | None = None, as_option: bool = False) -> str | None:
    """Where `key`, which `role` does not take, belongs ("--num-generations is a sampler option: pass
    it to `swarm sampler`"), or None when no role takes it. `spelled` is how the user wrote it."""
    spelled = spelled or key
    if role == "sampler" and key in RUN_WIDE:
        return (f"{spelled} is a setting of the whole run, which the learner announces with every version and samplers "
                f"follow: {'pass it to `swarm learner`' if as_option else 'put it in the [learner] table'}")
    others = [r for r in roles_taking(key) if r != role]
    if not others:
        return None
    first, rest = others[0], others[1:]
    if as_option:
        also = f" (or `swarm {rest[0]}`)" if rest else ""
        return f"{spelled} is a {first} option: pass it to `swarm {first}`{also}"
    also = f" (or [{rest[0]}])" if rest else ""
    return f"{spelled} is a {first} setting: put it in the [{first}] table{also}"


def close_names(key: str, known) -> list[str]:
    """Up to three known names close to `key` (difflib's ratio, as git's "did you mean")."""
    return difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)


def unknown_setting(key: str, role: str) -> str:
    """One line on a config-file key that `role` does not take: where it belongs, or what it may mean."""
    elsewhere = belongs_elsewhere(key, role)
    if elsewhere:
        return elsewhere
    close = close_names(key, field_names(CONFIGS[role]))
    return f"{key!r} is not a {role} setting" + (f" (did you mean {' or '.join(close)}?)" if close else "")
