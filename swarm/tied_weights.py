"""Tied parameters, published once: the state a learner publishes, hashes and checkpoints holds each
parameter under one name, and whoever loads it into a model re-ties the aliases.

A model with tied embeddings (Qwen3-0.6B: `lm_head.weight` is `model.embed_tokens.weight`, 151,936 x
1,024) lists the one tensor twice in `state_dict()`; published as is, it would travel, be diffed and
be hashed twice (26% more bytes in every snapshot of Qwen3-0.6B). Aliases are found by storage (two
names whose tensors are views of the same memory with the same layout), which is what a tie is,
whatever the model calls it; `_tied_weights_keys` and `config.tie_word_embeddings` only pick which
name of a pair is the alias (the output layer's), so that the kept name does not depend on the
order of `state_dict()`.
"""

from __future__ import annotations

from typing import Mapping

import torch


def _layout(t: torch.Tensor) -> tuple:
    """What makes two tensors one: the same memory, read the same way."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _declared_aliases(model) -> set[str]:
    """The names a model says are tied to another parameter (Hugging Face's `_tied_weights_keys`:
    a list, or in newer versions a {alias: source} map; `lm_head.weight` with tie_word_embeddings)."""
    declared = getattr(model, "_tied_weights_keys", None) or ()
    names = set(declared.keys() if isinstance(declared, Mapping) else declared)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        names.add("lm_head.weight")
    return names


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: kept name} for every name of `model.state_dict()` whose tensor is another name's
    (shares its storage and layout). The kept name is one the model does not declare as an alias,
    else the first in state_dict order."""
    state = model.state_dict(keep_vars=True)
    declared = _declared_aliases(model)
    groups: dict[tuple, list[str]] = {}
    for name, tensor in state.items():
        if tensor.numel() == 0 or tensor.device.type == "meta":
            continue  # no memory to share (and an empty tensor's data_ptr says nothing)
        groups.setdefault(_layout(tensor), []).append(name)
    aliases = {}
    for names in groups.values():
        if len(names) > 1:
            kept = next((n for n in names if not any(n.endswith(d) for d in declared)), names[0])
            aliases.update({n: kept for n in names if n != kept})
    return aliases


def unique_state(model: torch.nn.Module, dtype: torch.dtype | None = None, *, copy: bool = False,
                 on_host: bool = True) -> dict[str, torch.Tensor]:
    """model.state_dict() without aliases of the same parameter, detached; floating-point tensors
    cast to `dtype` when given (a learner publishes in the dtype samplers run). What a learner
    publishes, hashes (`master_hash`) and checks a checkpoint against. `copy`: every tensor a copy,
    never a view of the model's own (a publisher encodes it while the next step trains), on the CPU,
    or with `on_host=False` where the model is: on a GPU that is a cast of each tensor there (about a
    millisecond at Qwen3-0.6B shape, where casting and copying to the host in the training thread took
    2.6 s a version on an H100 machine), and the publisher's thread takes it to the host."""
    aliases = tied_aliases(model)
    if copy:
        where = "cpu" if on_host else None
        return {k: v.detach().to(where, dtype if dtype is not None and v.is_floating_point() else v.dtype, copy=True)
                for k, v in model.state_dict().items() if k not in aliases}
    return {k: (v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach())
            for k, v in model.state_dict().items() if k not in aliases}


def load_unique_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load a state (as `unique_state` makes it) into `model`, strictly: every name of the model's
    must be in `state` but its tied aliases, which take the kept tensor's values through the tie
    (the tie holds: one storage after the load). An alias given too must equal its kept tensor."""
    aliases = tied_aliases(model)
    names = set(model.state_dict())
    missing = sorted(names - set(aliases) - set(state))
    unexpected = sorted(set(state) - names)
    if missing or unexpected:
        raise RuntimeError(f"the state does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]} "
                           "(a version of another model?)")
    for alias, kept in aliases.items():
        if alias in state and not torch.equal(state[alias].to(state[kept].device), state[kept]):
            raise RuntimeError(f"{alias} is tied to {kept} in the model, but the state gives them different values")
    model.load_state_dict(state, strict=False)  # checked above: only tied aliases are left out
