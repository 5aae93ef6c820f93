"""Generation with Hugging Face `model.generate`, on CPU or GPU.

Log-probs come from the processed scores `generate` itself samples from (temperature, top-k,
top-p applied), so recording them costs one log-softmax per step and no extra forward pass.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from swarm.generation.base import Generation, SamplingParams
from swarm.model.loading import load_policy


class TransformersBackend:
    name = "transformers"

    def __init__(self, model, tokenizer, *, batch_size: int = 64) -> None:
        """batch_size: prompts per `generate` call (each expands to G rows)."""
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size

    @classmethod
    def from_pretrained(cls, model_dir: str, *, device: str = "cpu", dtype: str = "float32", batch_size: int = 64):
        model, tokenizer = load_policy(model_dir, device=device, dtype=dtype)
        return cls(model, tokenizer, batch_size=batch_size)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    partial_updates = False  # every tensor, every time (strict)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], previous: Mapping[str, torch.Tensor] | None = None) -> None:
        """Copy a whole version into the model (cast to its dtype, on its device)."""
        self.model.load_state_dict(state_dict, strict=True)

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[Generation]:
        if params.seed is not None:
            torch.manual_seed(params.seed)
        out: list[Generation] = []
        for start in range(0, len(prompts), self.batch_size):
            out.extend(self._generate_batch(prompts[start : start + self.batch_size], params))
        return out

    def _generate_batch(self, prompts: Sequence[str], params: SamplingParams) -> list[Generation]:
        g = params.num_completions
        enc = self.tokenizer(list(prompts), return_tensors="pt", padding=True).to(self.device)
        input_ids = enc["input_ids"].repeat_interleave(g, dim=0)
        attention = enc["attention_mask"].repeat_interleave(g, dim=0)
        eos = self.tokenizer.eos_token_id
        sampling = {} if params.greedy else dict(
            do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None
        )
        result = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            max_new_tokens=params.max_new_tokens,
            **(sampling or {"do_sample": False}),
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=eos,
            return_dict_in_generate=True,
            output_scores=True,
        )
        new_tokens = result.sequences[:, input_ids.size(1) :]  # (B*G, steps)
        scores = torch.stack(result.scores, dim=1).float()  # (B*G, steps, V) processed logits
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        return self._split(enc, new_tokens.cpu(), logprobs.cpu(), len(prompts), g, eos)

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
