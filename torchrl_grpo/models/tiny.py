"""The tiny model: a random 2-layer Qwen2 and a byte-level BPE tokenizer trained here.

Built in seconds and bit-identical on every build (tests and smoke runs; it learns nothing useful).
"""
from __future__ import annotations

import json
import pathlib
import random

import torch

# Bump whenever `build` changes what it writes: old caches are then ignored.
CACHE_DIR = "tiny-random-v1"

_ENDOFTEXT, _IM_START, _IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Plain ChatML without an injected default system prompt.
_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen2's pre-tokenizer split: contractions, words, single digits, punctuation runs, newlines, spaces.
_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_VOCAB = 640  # a multiple of 64 (no padding rows); the corpus supports ~670 tokens at min_frequency 2


def _corpus(n: int = 600) -> list[str]:
    """Deterministic English + digits text shaped like grade-school word problems and their answers."""
    rng = random.Random(0)
    names = ["Ana", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Kira", "Liam",
             "Maya", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wendy", "Yusuf"]
    items = ["apples", "books", "marbles", "cookies", "pencils", "stickers", "coins", "eggs", "cards", "shells",
             "oranges", "bottles", "flowers", "tickets", "candles", "buttons", "stamps", "puzzles", "balloons"]
    places = ["store", "school", "park", "farm", "library", "market", "garden", "museum", "bakery", "station"]
    adjs = ["red", "blue", "green", "small", "large", "old", "new", "heavy", "light", "round", "sweet", "cheap"]
    verbs = ["bought", "found", "collected", "baked", "sold", "painted", "picked", "counted", "packed", "won"]
    units = [("hour", "hours"), ("day", "days"), ("week", "weeks"), ("dollar", "dollars"), ("mile", "miles")]
    out = [
        "Let's think step by step.",
        "The answer is a number. Write it after ####.",
        "You are a helpful assistant. Solve the problem and give the final answer.",
        "First, we find the total. Then we subtract what was used. Finally, we divide by the number of people.",
        " ".join(str(i) for i in range(100)),
    ]
    while len(out) < n:
        a, b, c = rng.randint(2, 99), rng.randint(2, 49), rng.randint(2, 9)
        p, q, it, pl = rng.choice(names), rng.choice(names), rng.choice(items), rng.choice(places)
        adj, verb, (one, many) = rng.choice(adjs), rng.choice(verbs), rng.choice(units)
        kind = rng.randrange(7)
        if kind == 0:
            out.append(f"{p} has {a} {adj} {it}. {q} gives {p} {b} more. How many {it} does {p} have now? "
                       f"{a} + {b} = {a + b}. #### {a + b}")
        elif kind == 1:
            out.append(f"{p} {verb} {a + b} {it} at the {pl} and gave {b} to {q}. How many are left? "
                       f"{a + b} - {b} = {a}. #### {a}")
        elif kind == 2:
            out.append(f"Each box holds {c} {it}. There are {b} boxes. How many {it} are there in total? "
                       f"{b} * {c} = {b * c}. #### {b * c}")
        elif kind == 3:
            out.append(f"{p} shares {b * c} {it} equally among {c} friends. "
                       f"Each friend gets {b * c} / {c} = {b}. #### {b}")
        elif kind == 4:
            out.append(f"{p} works {c} {many} a week and earns {b} dollars per {one}. "
                       f"That is {c} * {b} = {c * b} dollars. The answer is {c * b}.")
        elif kind == 5:
            out.append(f"A {adj} {it[:-1]} costs {c} dollars. {q} pays with a {b + c} dollar note. "
                       f"The change is {b + c} - {c} = {b}. #### {b}")
        else:
            out.append(f"{p} walks {a} minutes to the {pl}, then {b} minutes home. "
                       f"In total {p} walks {a + b} minutes. The answer is {a + b}.")
    return out


def _train_tokenizer():
    """Byte-level BPE trained on the fixed corpus, padded with reserved specials to exactly _VOCAB."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [_ENDOFTEXT, _IM_START, _IM_END]
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Every id the model can emit must decode: fill the rest of the embedding rows with reserved tokens.
    reserved = [f"<|reserved_{i}|>" for i in range(_VOCAB - tok.get_vocab_size())]
    if reserved:
        tok.add_special_tokens(reserved)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=_IM_END,
        pad_token=_ENDOFTEXT,
        chat_template=_CHATML,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def build(out: pathlib.Path) -> None:
    """Tokenizer + 2-layer Qwen2 (head dim 32: vLLM CPU attention's smallest size), seeded weights."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = _train_tokenizer()
    vocab = -(-len(tok) // 64) * 64
    eos, pad = tok.convert_tokens_to_ids(_IM_END), tok.convert_tokens_to_ids(_ENDOFTEXT)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=pad,  # as Qwen2: <|endoftext|>, never prepended by the tokenizer
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):  # identical weights every build; caller's RNG untouched
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out)
    # The chat template goes into tokenizer_config.json (not chat_template.jinja), under the class name
    # every transformers version knows, so that older readers load the folder too.
    tok.save_pretrained(out, save_jinja_files=False)
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
