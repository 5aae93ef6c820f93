"""Generation with Hugging Face `model.generate`, on CPU or GPU.

Log-probs come from the distribution `generate` itself samples from, with no extra forward pass and
no memory that grows with completion length x vocabulary: `SampledLogprobs`, the last logits
processor, turns each step's logits into the sampling distribution with the learner's own
processing (swarm.logprobs.process_logits: temperature, top-k, top-p) and keeps, of the step
before, only the log-prob of the token sampled from it. (`output_scores=True` kept every step's
full-vocabulary scores instead: 12 bytes per row, step and vocabulary entry once stacked and
log-softmaxed, 4.1 GB above the model for 8 rows of 256 tokens with Qwen3's vocabulary.)

Rows per `generate` call are set by a token budget (`batch_tokens`: rows x (prompt + new tokens)),
which bounds the KV cache whatever the prompts' and completions' lengths. Where CUDA runs a model of
at least STATIC_CACHE_MIN_PARAMETERS, the KV cache is static (preallocated for the call), with which
transformers compiles the decoding step by itself: at Qwen3-0.6B shape on an H100, 8,602 completion
tokens/s after a 45 s compile (benchmarks/gpu_check.py), against 860 before. A compile is made for
each shape of call, so prompts are then padded to a multiple of PROMPT_PAD_MULTIPLE tokens (the rows
of one round share a few shapes). A small model is left eager: there its compiles cost more than
they save (the embedded demo's two samplers had not sampled a group 60 s into a GPU run). On CPU the
dynamic cache, which compiles nothing.

A LoRA run (swarm/lora.py): `use_adapter` wraps the loaded base model with the run's adapter once,
and each version then copies the adapter's tensors alone (the base is never reloaded). Merged
(`merged=True`), the adapter is added into the base weights, so generation runs at the base model's
speed, and each version is unmerged and merged again; unmerged, every adapted layer runs its two
small extra matmuls per token, and a version swap only copies the adapter.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from transformers import LogitsProcessor, LogitsProcessorList

from swarm.fabric.weights.delta import state_hash
from swarm.generation.base import Generation, SamplingParams
from swarm.lora import AdapterSpec, base_state, load_policy_state, set_merged, wrap_as
from swarm.logprobs import process_logits
from swarm.model.loading import load_policy

BATCH_TOKENS = 65536  # rows x (prompt + new tokens) per generate call: the KV cache's bound
STATIC_CACHE_MIN_PARAMETERS = 100_000_000  # below this, decoding stays eager on CUDA too (module docstring)
PROMPT_PAD_MULTIPLE = 64  # with a static cache: prompt lengths padded up to a multiple of this
# generate's own warpers, all off: SampledLogprobs processes the logits itself, last of all (generate
# would put warpers after any processor it is given, and a model's generation_config may set them)
NO_WARPERS = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=None, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0)


class SampledLogprobs(LogitsProcessor):
    """The last logits processor of a `generate` call: each step's logits become the sampling
    distribution (the learner's processing, so the two agree by construction), and of the step
    before only the log-prob of the token sampled from it is kept: by the next call it is the last
    token of `input_ids`. Memory: two (rows, vocabulary) tensors, whatever the length."""

    def __init__(self, params: SamplingParams) -> None:
        # greedy decoding takes the argmax of the unprocessed distribution, and records under it
        self.temperature = 1.0 if params.greedy else params.temperature
        self.top_k, self.top_p = (0, 1.0) if params.greedy else (params.top_k, params.top_p)
        self._previous: tuple[torch.Tensor, torch.Tensor] | None = None  # processed (B, V), its logsumexp (B,)
        self._picked: list[torch.Tensor] = []  # (B,) a step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._take(input_ids[:, -1])
        processed = process_logits(scores, self.temperature, self.top_k, self.top_p)
        self._previous = (processed, torch.logsumexp(processed, dim=-1))
        return processed

    def _take(self, tokens: torch.Tensor) -> None:
        if self._previous is not None:
            processed, total = self._previous
            self._picked.append(processed.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - total)
            self._previous = None

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """(B, steps) log-probs of `new_tokens` (B, steps), the tokens this call generated."""
        if new_tokens.size(1):
            self._take(new_tokens[:, -1])
        if len(self._picked) != new_tokens.size(1):
            raise RuntimeError(f"recorded {len(self._picked)} steps for {new_tokens.size(1)} new tokens: "
                               "generate ran a step without its logits processors")
        return torch.stack(self._picked, dim=1) if self._picked else new_tokens.new_zeros(new_tokens.shape, dtype=torch.float32)


class TransformersBackend:
    name = "transformers"

    def __init__(self, model, tokenizer, *, batch_tokens: int = BATCH_TOKENS, static_cache: bool | None = None) -> None:
        """batch_tokens: rows x (prompt + new tokens) one `generate` call holds at most (each prompt
        expands to G rows; a call takes at least one prompt). static_cache: a preallocated KV cache
        and compiled decoding (None: where the model is on CUDA and has at least
        STATIC_CACHE_MIN_PARAMETERS parameters)."""
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_tokens = batch_tokens
        if static_cache is None:
            static_cache = self.device.type == "cuda" and sum(p.numel() for p in model.parameters()) >= STATIC_CACHE_MIN_PARAMETERS
        self.static_cache = static_cache
        self.adapter: AdapterSpec | None = None  # a LoRA run's adapter, once `use_adapter` put it on
        self.merged = False

    @classmethod
    def from_pretrained(cls, model_dir: str, *, device: str = "cpu", dtype: str = "float32", batch_tokens: int = BATCH_TOKENS):
        model, tokenizer = load_policy(model_dir, device=device, dtype=dtype)
        return cls(model, tokenizer, batch_tokens=batch_tokens)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    partial_updates = False  # every tensor, every time (strict)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], previous: Mapping[str, torch.Tensor] | None = None) -> None:
        """Copy a whole version into the model (cast to its dtype, on its device); a tied parameter,
        published once, reaches its aliases through the tie. A LoRA run's version: the adapter alone."""
        load_policy_state(self.model, state_dict)

    def base_hash(self) -> str:
        """The hash of the base model this backend holds (swarm.lora.base_state: in bfloat16, so a
        float32 or bfloat16 copy of the run's base matches; a float16 one does not)."""
        return state_hash(base_state(self.model))

    def use_adapter(self, spec: AdapterSpec, *, merged: bool = False) -> None:
        """Put a LoRA run's adapter (zero until a version is loaded) on the base model, once."""
        if self.adapter is not None:
            if self.adapter != spec:
                raise RuntimeError(f"this backend holds {self.adapter.describe()}, not {spec.describe()}")
            return
        self.model = wrap_as(self.model, spec)
        set_merged(self.model, merged)
        self.adapter, self.merged = spec, merged

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[Generation]:
        if params.seed is not None:
            torch.manual_seed(params.seed)
        out: list[Generation] = []
        for batch in self.batches(prompts, params):
            out.extend(self._generate_batch(batch, params))
        return out

    def batches(self, prompts: Sequence[str], params: SamplingParams) -> list[Sequence[str]]:
        """`prompts` in calls of at most `batch_tokens` rows x (longest prompt + new tokens) each."""
        lengths = [len(ids) for ids in self.tokenizer(list(prompts))["input_ids"]]
        out, start = [], 0
        while start < len(prompts):
            end, longest = start, 0
            while end < len(prompts):
                longest = max(longest, lengths[end])
                if end > start and (end + 1 - start) * params.num_completions * (longest + params.max_new_tokens) > self.batch_tokens:
                    break
                end += 1
            out.append(prompts[start:end])
            start = end
        return out

    def _generate_batch(self, prompts: Sequence[str], params: SamplingParams) -> list[Generation]:
        g = params.num_completions
        enc = self.tokenizer(list(prompts), return_tensors="pt", padding=True,
                             pad_to_multiple_of=PROMPT_PAD_MULTIPLE if self.static_cache else None).to(self.device)
        new_tokens, logprobs = self.sample(enc["input_ids"].repeat_interleave(g, dim=0),
                                           enc["attention_mask"].repeat_interleave(g, dim=0), params)
        return self._split(enc, new_tokens.cpu(), logprobs.cpu(), len(prompts), g, self.tokenizer.eos_token_id)

    @torch.no_grad()
    def sample(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (B, Tp) left-padded -> (new tokens (B, steps), their log-probs (B, steps) under the
        distribution each was sampled from). Rows that end early are padded after their EOS."""
        recorder = SampledLogprobs(params)
        sequences = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=params.max_new_tokens,
            do_sample=not params.greedy,
            **({} if params.greedy else NO_WARPERS),
            logits_processor=LogitsProcessorList([recorder]),
            **({"cache_implementation": "static"} if self.static_cache else {}),
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        new_tokens = sequences[:, input_ids.size(1) :]
        return new_tokens, recorder.finish(new_tokens)

    def _split(self, enc, new_tokens, logprobs, num_prompts: int, g: int, eos: int) -> list[Generation]:
        rows, row_lps = new_tokens.tolist(), logprobs.tolist()  # one conversion each, not per row
        prompt_ids, prompt_mask = enc["input_ids"].tolist(), enc["attention_mask"].tolist()
        ends, finished = [], []
        for toks in rows:
            # the completion runs to and includes the first EOS; after it, generate pads
            done = eos in toks
            ends.append(toks.index(eos) + 1 if done else len(toks))
            finished.append(done)
        completions = [toks[:end] for toks, end in zip(rows, ends)]
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        gens = []
        for p in range(num_prompts):
            prompt = [t for t, m in zip(prompt_ids[p], prompt_mask[p]) if m]
            span = range(p * g, (p + 1) * g)
            gens.append(Generation(
                prompt,
                [completions[r] for r in span],
                [row_lps[r][: ends[r]] for r in span],
                [texts[r] for r in span],
                [finished[r] for r in span],
            ))
        return gens
