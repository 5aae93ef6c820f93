"""A mid-size policy built locally: the Qwen3 architecture at tens of millions of parameters, with a
byte-level BPE tokenizer trained on text this module generates. For measuring what scales with the
model (weight deltas, version swaps, memory), not for accuracy: the weights are a fresh random
initialisation (training a 50M model on two CPU cores is out of reach), so its completions are
noise.

    python -m swarm.model.midsize OUT_DIR [--params 50000000] [--seed 0]

writes a Hugging Face model directory (config.json, model.safetensors, tokenizer.json with a ChatML
chat template, eos <|im_end|> and pad <|endoftext|> as in Qwen3's instruct tokenizers) that
`--model OUT_DIR` and `swarm.model.loading.load_policy` accept. `midsize_model_dir()` builds it once
into the user's cache directory (next to the embedded policy's) and reuses it.

The shapes follow Qwen3's proportions: head_dim 64, half as many key-value heads as query heads,
an MLP three times the hidden size, tied embeddings; the hidden size and depth are picked so that
the parameter count is close to `params_target` at about 40 hidden units per layer of depth. The
weights are saved in float32, as a learner's master weights are, and they are off the bf16 grid,
as master weights are after a few hundred steps of training (a run that starts from a bf16
checkpoint starts on the grid; benchmarks/delta_scale.py measures both).

The tokenizer is trained with `tokenizers` (BPE, byte-level, digits split one by one as Qwen's
pre-tokenizer does) on about 3 MB of generated text: the arithmetic task's prompts and boxed
answers at every difficulty, templated word problems, and templated English prose. The corpus's
vocabulary is finite, so BPE stops before VOCAB_TARGET once every word is one token; the model's
embedding is the tokenizer's size rounded up to a multiple of 64.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

from swarm.paths import models_cache
from swarm.tasks.synthetic import ArithmeticTask

RECIPE_FILE = "gepo_swarm_midsize.json"
DEFAULT_PARAMS = 50_000_000
VOCAB_TARGET = 8192
CORPUS_BYTES = 3_000_000
HEAD_DIM = 64
LAYERS_PER_HIDDEN = 1 / 40  # depth ~ hidden / 40 (Qwen3-0.6B: 28 layers at 1024; narrower models are shallower)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS, PAD = "<|im_end|>", "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Builds are cached under a hash of recipe(): bump RECIPE_VERSION whenever the corpus, the tokenizer
# or the model's construction changes, or a stale cached build would be used.
RECIPE_VERSION = 1


# ---------------------------------------------------------------------------------------------
# the corpus

NAMES = ("Alice Bob Carol David Emma Farid Grace Hiro Ines James Kofi Lena Maria Nadia Omar Priya Quinn Rosa Sam Tariq "
         "Uma Victor Wen Ximena Yusuf Zoe Anna Ben Chloe Diego Elena Felix Greta Hana Ivan Julia Karim Laura Mateo Nina "
         "Oscar Paula Rahul Sofia Tom Valentina Wei Yara Aiko Bruno Clara Dmitri Esther Femi Gabriel Helga Isaac Jana "
         "Kenji Lucia Marcus Noor Olga Pedro Rania Stefan Thandi Ulrich Vera William Xavier Yuki Zara Ahmed Beatriz "
         "Connor Dalia Emil Fatima Gustav Hassan Ingrid Jorge Keiko Liam Mina Nikolai Olivia Pablo Rhea Sven Tanya").split()
# singular nouns (plurals are made by rule) and the irregular few
NOUNS = list(dict.fromkeys(("apple orange pencil book marble sticker cookie coin stamp shell card bottle candle box plate cup spoon chair "
         "table flower tree seed egg loaf ticket button ribbon balloon kite shirt sock hat brick nail tile bag basket jar "
         "pear plum lemon melon carrot potato onion bean letter parcel chicken goat duck bike car bus train boat lamp "
         "clock key bell window door wall roof garden road street river lake mountain valley hill island forest field "
         "meadow beach harbour bridge tower castle village town city market school library museum station hospital "
         "theatre factory office kitchen workshop bakery farm barn stable church palace cottage cabin tent ladder rope "
         "hammer saw drill brush bucket shovel wheel engine machine computer phone camera radio guitar piano violin drum "
         "song story poem picture painting map journal diary newspaper magazine recipe lesson problem answer question "
         "puzzle game team player coach teacher student doctor nurse farmer baker painter writer singer driver pilot "
         "sailor soldier engineer scientist merchant neighbour friend stranger visitor traveller guest brother sister "
         "mother father uncle aunt cousin daughter son king queen prince princess dragon wizard knight horse dog cat "
         "bird rabbit mouse fox wolf bear lion tiger elephant monkey snake frog turtle whale dolphin owl eagle spider "
         "bee butterfly morning evening night afternoon week month year season winter spring summer autumn holiday "
         "journey voyage adventure festival party dinner breakfast lunch meal bread cheese butter soup cake pie "
         "sandwich salad coffee tea juice water milk honey sugar salt pepper rice noodle tomato cherry grape peach "
         "mango banana lemon coat scarf glove boot shoe umbrella blanket pillow candle mirror basket wagon cart "
         "coin purse wallet price cost profit share half quarter third dozen hundred thousand number total sum "
         "difference product result score record plan idea reason secret promise choice chance mistake lesson "
         "distance height weight length width speed minute hour second metre kilometre litre gram kilogram").split()))
VERBS = ("walk talk jump climb paint cook bake clean count carry paddle open close visit watch listen learn teach "
         "build repair plant water harvest deliver collect gather borrow return trade measure weigh divide multiply "
         "add subtract check compare order arrange sort fold wrap pack unpack travel sail fly drive ride row swim "
         "search discover explore follow guide help invite answer question explain describe notice remember forget "
         "finish start change share plan prepare practise play laugh smile wonder worry hurry wait rest").split()
IRREGULAR = {"buy": "bought", "find": "found", "give": "gave", "take": "took", "make": "made", "bring": "brought",
             "sell": "sold", "lose": "lost", "eat": "ate", "win": "won", "see": "saw", "read": "read", "write": "wrote",
             "sing": "sang", "run": "ran", "keep": "kept", "leave": "left", "hold": "held", "send": "sent", "spend": "spent",
             "think": "thought", "know": "knew", "begin": "began", "break": "broke", "choose": "chose", "draw": "drew",
             "forget": "forgot", "grow": "grew", "hide": "hid", "meet": "met", "pay": "paid", "put": "put", "say": "said",
             "sit": "sat", "sleep": "slept", "speak": "spoke", "stand": "stood", "teach": "taught", "tell": "told",
             "throw": "threw", "wear": "wore"}
ADJECTIVES = ("red blue green yellow purple orange brown black white grey small large tiny huge old new young ancient "
              "modern heavy light bright dark quiet loud busy calm careful careless happy sad tired clever kind brave "
              "gentle proud shy curious eager patient polite rude honest strange famous rare common round square flat "
              "wooden golden silver stone glass paper fresh ripe sweet sour bitter salty empty full long short tall "
              "narrow wide deep shallow warm cold hot cool wet dry soft hard smooth rough clean dirty cheap expensive "
              "rich poor early late quick slow simple difficult easy strong weak sharp plain fancy lucky useful").split()
ADVERBS = ("quickly slowly carefully quietly happily sadly eagerly patiently suddenly finally usually often rarely "
           "always never sometimes gently loudly proudly easily nearly almost together alone outside inside").split()
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
MONTHS = "January February March April May June July August September October November December".split()
VERBS_GAIN = ("buys", "finds", "receives", "collects", "picks", "bakes", "makes", "wins", "borrows", "gathers")
VERBS_LOSS = ("gives away", "sells", "loses", "eats", "uses", "breaks", "lends", "drops", "donates", "sends")
CONNECTIVES = ("Then", "After that", "Later", "Next", "In the afternoon", "That evening", "The next day", "Meanwhile")
PLACES = ("market school library garden farm bakery station harbour museum park kitchen workshop office village "
          "city shop field forest river bridge hospital theatre warehouse factory island castle").split()
QUESTIONS = (
    "How many {obj} does {name} have now?",
    "How many {obj} are left?",
    "What is the total number of {obj}?",
)


def plural(noun: str) -> str:
    irregular = {"loaf": "loaves", "mouse": "mice", "child": "children", "knife": "knives", "sheep": "sheep",
                 "fish": "fish", "potato": "potatoes", "tomato": "tomatoes", "hero": "heroes", "wolf": "wolves"}
    if noun in irregular:
        return irregular[noun]
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def past(verb: str) -> str:
    if verb in IRREGULAR:
        return IRREGULAR[verb]
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ied"
    return verb + "ed"


def ing(verb: str) -> str:
    if verb.endswith("e") and not verb.endswith("ee"):
        return verb[:-1] + "ing"
    return verb + "ing"


def third(verb: str) -> str:
    if verb.endswith(("s", "x", "ch", "sh", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


OBJECTS = [plural(n) for n in NOUNS[:NOUNS.index('window')]]  # things one counts
ALL_VERBS = VERBS + list(IRREGULAR)


def _noun_phrase(rng: random.Random) -> str:
    noun = rng.choice(NOUNS)
    roll = rng.random()
    if roll < 0.3:
        return f"the {rng.choice(ADJECTIVES)} {noun}"
    if roll < 0.5:
        return f"{rng.randrange(2, 1000)} {rng.choice(ADJECTIVES)} {plural(noun)}"
    if roll < 0.65:
        return f"{rng.choice(NAMES)}'s {noun}"
    if roll < 0.8:
        return f"some {plural(noun)}"
    return f"a {noun}" if noun[0] not in "aeiou" else f"an {noun}"


def _sentence(rng: random.Random) -> str:
    who = rng.choice(NAMES) if rng.random() < 0.6 else _noun_phrase(rng).capitalize()
    verb = rng.choice(ALL_VERBS)
    tense = rng.random()
    if tense < 0.45:
        head = f"{who} {past(verb)}"
    elif tense < 0.75:
        head = f"{who} {third(verb)}"
    else:
        head = f"{who} was {ing(verb)}"
    tail = rng.random()
    if tail < 0.4:
        body = f"{head} {_noun_phrase(rng)} near the {rng.choice(NOUNS)}"
    elif tail < 0.6:
        body = f"{head} {rng.choice(ADVERBS)} on {rng.choice(DAYS)}"
    elif tail < 0.8:
        reason = f"{rng.choice(NAMES)} {past(rng.choice(ALL_VERBS))} {_noun_phrase(rng)}"
        body = f"{head} {_noun_phrase(rng)} in {rng.choice(MONTHS)}, because {reason}"
    else:
        body = f"{head} {_noun_phrase(rng)} and {_noun_phrase(rng)} {rng.choice(ADVERBS)}"
    return body + rng.choice(".....!?")


def _word_problem(rng: random.Random) -> tuple[str, int]:
    name, name2 = rng.sample(NAMES, 2)
    obj = rng.choice(OBJECTS)
    have = rng.randrange(2, 200)
    text = [f"{name} has {have} {obj}."]
    total = have
    for _ in range(rng.randrange(1, 4)):
        if rng.random() < 0.5 or total < 2:
            k = rng.randrange(1, 100)
            text.append(f"{rng.choice(CONNECTIVES)}, {name} {rng.choice(VERBS_GAIN)} {k} more {obj}.")
            total += k
        else:
            k = rng.randrange(1, total)
            text.append(f"{rng.choice(CONNECTIVES)}, {name} {rng.choice(VERBS_LOSS)} {k} {obj} to {name2}.")
            total -= k
    if rng.random() < 0.3:
        per = rng.randrange(2, 10)
        text.append(f"{name2} has {per} times as many {obj} as {name}.")
        total *= per
        text.append(f"How many {obj} does {name2} have?")
    else:
        text.append(rng.choice(QUESTIONS).format(obj=obj, name=name))
    return " ".join(text), total


def _prose(rng: random.Random) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randrange(2, 7)))


def make_corpus(seed: int = 0, target_bytes: int = CORPUS_BYTES) -> list[str]:
    """Documents of generated text, about `target_bytes` in all: arithmetic prompts with boxed
    answers (the task's own format), word problems with worked answers, and prose."""
    rng = random.Random(seed)
    docs: list[str] = []
    for difficulty in (1, 2, 3, 4):
        for p in ArithmeticTask(difficulty, size=3000).problems("train"):
            docs.append(f"{p.prompt}\\boxed{{{p.answer}}}")
    size = sum(len(d) for d in docs)
    while size < target_bytes:
        roll = rng.random()
        if roll < 0.45:
            question, answer = _word_problem(rng)
            doc = f"{question} Put the final answer in \\boxed{{}}.\nThe answer is \\boxed{{{answer}}}."
        else:
            doc = _prose(rng)
        docs.append(doc)
        size += len(doc)
    return docs


# ---------------------------------------------------------------------------------------------
# tokenizer and model

def train_tokenizer(docs: list[str], vocab_size: int = VOCAB_TARGET):
    """A byte-level BPE `PreTrainedTokenizerFast` trained on `docs` (digits split one by one)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS, pad_token=PAD, additional_special_tokens=["<|im_start|>"],
        padding_side="left", clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE,
    )


def layer_params(hidden: int) -> int:
    """Parameters of one Qwen3 decoder layer at `hidden` (head_dim 64, kv heads = q heads / 2, MLP 3x)."""
    heads = hidden // HEAD_DIM
    kv = max(1, heads // 2)
    attention = hidden * heads * HEAD_DIM * 2 + hidden * kv * HEAD_DIM * 2 + 2 * HEAD_DIM  # q, o, k, v, q/k norms
    return attention + 3 * hidden * 3 * hidden + 2 * hidden  # MLP, two RMSNorms


def architecture(params_target: int, vocab_size: int) -> dict:
    """Qwen3Config fields whose parameter count is close to `params_target`."""
    best = None
    for hidden in range(256, 4096 + 1, 128):
        layers = round((params_target - vocab_size * hidden - hidden) / layer_params(hidden))
        if layers < 1:
            break
        score = abs(layers - hidden * LAYERS_PER_HIDDEN) / (hidden * LAYERS_PER_HIDDEN)
        if best is None or score < best[0]:
            best = (score, hidden, layers)
    if best is None:
        raise ValueError(f"params_target {params_target} is too small for a Qwen3 model with a {vocab_size}-token vocabulary")
    _, hidden, layers = best
    heads = hidden // HEAD_DIM
    return {"hidden_size": hidden, "intermediate_size": 3 * hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2), "head_dim": HEAD_DIM,
            "max_position_embeddings": 2048, "rope_theta": 1_000_000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-6}


def recipe(params_target: int, seed: int) -> dict:
    return {"version": RECIPE_VERSION, "params_target": params_target, "seed": seed, "vocab_target": VOCAB_TARGET,
            "corpus_bytes": CORPUS_BYTES, "head_dim": HEAD_DIM, "layers_per_hidden": LAYERS_PER_HIDDEN}


def recipe_hash(params_target: int, seed: int) -> str:
    return hashlib.sha256(json.dumps(recipe(params_target, seed), sort_keys=True).encode()).hexdigest()[:12]


def build_midsize_model(out_dir, *, params_target: int = DEFAULT_PARAMS, seed: int = 0) -> dict:
    """Write the model directory into `out_dir` (created if needed); returns what was built
    (parameters, vocabulary, architecture, seconds)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" in the middle of other output
    started = time.time()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    docs = make_corpus(seed)
    corpus_seconds = time.time() - started
    tokenizer = train_tokenizer(docs)
    tokenizer_seconds = time.time() - started - corpus_seconds
    vocab = -(-len(tokenizer) // 64) * 64
    arch = architecture(params_target, vocab)
    config = Qwen3Config(vocab_size=vocab, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.convert_tokens_to_ids(PAD), **arch)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float().eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    info = {"recipe": recipe(params_target, seed), "recipe_hash": recipe_hash(params_target, seed), "parameters": params,
            "tokenizer_size": len(tokenizer), "vocab_size": vocab, "architecture": arch,
            "corpus": {"documents": len(docs), "bytes": sum(len(d) for d in docs)},
            "seconds": {"corpus": round(corpus_seconds, 1), "tokenizer": round(tokenizer_seconds, 1),
                        "total": round(time.time() - started, 1)}}
    (out_dir / RECIPE_FILE).write_text(json.dumps(info, indent=2))
    return info


def midsize_model_dir(*, params_target: int = DEFAULT_PARAMS, seed: int = 0) -> Path:
    """The cached build for (params_target, seed), made first if needed (safe when several
    processes ask at once: one builds, the others wait and reuse it)."""
    target = models_cache() / f"midsize-qwen3-{params_target // 1_000_000}m-{recipe_hash(params_target, seed)}"
    if (target / RECIPE_FILE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / RECIPE_FILE).exists():
            tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
            try:
                build_midsize_model(tmp, params_target=params_target, seed=seed)
                tmp.rename(target)  # atomic: a half-built model is never visible under `target`
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_info(model_dir) -> dict:
    """What build_midsize_model recorded about the model in `model_dir`."""
    return json.loads((Path(model_dir) / RECIPE_FILE).read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swarm.model.midsize", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="directory to write (must not exist or be empty)")
    parser.add_argument("--params", type=int, default=DEFAULT_PARAMS, help="parameter count to aim at (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        parser.error(f"{out} exists and is not an empty directory")
    info = build_midsize_model(out, params_target=args.params, seed=args.seed)
    arch = info["architecture"]
    print(f"built {out}: {info['parameters'] / 1e6:.1f}M parameters (hidden {arch['hidden_size']}, "
          f"{arch['num_hidden_layers']} layers, vocabulary {info['tokenizer_size']} -> {info['vocab_size']}) "
          f"in {info['seconds']['total']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
