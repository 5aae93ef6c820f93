"""The embedded policy's tokenizer: one token per character of printable ASCII plus newline.

Character-level keeps the vocabulary tiny (~100 tokens) and lets a ~1 M-parameter model read
digits one by one, which is what arithmetic needs. Saved as a standard `tokenizer.json`, so
`AutoTokenizer.from_pretrained(dir)` loads it like any Hugging Face tokenizer.
"""

from __future__ import annotations

import string

EOS = "<|endoftext|>"
PAD = "<|pad|>"
UNK = "<|unk|>"
SPECIALS = [PAD, EOS, UNK]
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # digits, letters, punctuation, space, \n


def build_tokenizer():
    """A `PreTrainedTokenizerFast` over SPECIALS + CHARACTERS."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",  # samplers generate from left-padded prompts
        clean_up_tokenization_spaces=False,
    )
