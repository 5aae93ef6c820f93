"""The interface every generation backend implements, and its data types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

from pydantic import BaseModel, ConfigDict, Field

from swarm.config import GenerationSettings, default_of


class SamplingParams(BaseModel):
    """How completions are sampled. Backends record log-probs under the distribution these settings
    define (swarm.logprobs recomputes the same). A hub model's own generation_config may add
    processing the learner does not recompute (e.g. a repetition penalty): not yet guarded."""

    model_config = ConfigDict(extra="forbid")

    num_completions: int = Field(default_of(GenerationSettings, "num_generations"), ge=1,
                                 description="G: completions per prompt (the GEPO group size)")
    temperature: float = Field(1.0, ge=0, description="0 means greedy decoding; 1 leaves the policy's distribution as it is")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    max_new_tokens: int = Field(default_of(GenerationSettings, "max_completion_length"), ge=1)
    seed: int | None = Field(None, description="seed for reproducible sampling (None: not reseeded)")
    stop_strings: list[str] = Field(default_factory=list, description="a completion ends with the first of these it "
                                                                      "writes (its tokens up to and including it)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Generation:
    """One prompt and its G completions. Completion token lists end with EOS when `finished`."""

    prompt_ids: list[int]
    completion_ids: list[list[int]]
    completion_logprobs: list[list[float]]  # per token, under the sampling distribution
    texts: list[str]  # decoded completions, special tokens removed
    finished: list[bool] = field(default_factory=list)  # ended with EOS (False: hit max_new_tokens)

    def num_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)


class GenerationBackend(Protocol):
    name: str
    tokenizer: object  # the policy's tokenizer (tasks build prompts with it)

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[Generation]:
        """G completions for each prompt, in prompt order."""
        ...

    partial_updates: bool  # whether load_state_dict takes only the tensors that changed

    def load_state_dict(self, state_dict: Mapping[str, "object"], previous: Mapping[str, "object"] | None = None) -> None:
        """Replace the policy weights in place (a new policy version). With `partial_updates`, only
        the tensors that changed since `previous` (the version held now) may be given. Raises
        RuntimeError when the backend can tell that the update did not take."""
        ...
