"""Small-vocabulary tokenizer of the testbed model.

A character tokenizer makes a 30-record context 1,000+ tokens long and a 4-letter key four tokens,
so a tiny model must learn multi-token matching over long spans before it can answer anything (the
first training attempt never left that plateau, ``eval/testbed/NOTES.md``). This vocabulary makes
the units of the tasks single tokens instead: every word the generators use (filler words,
``KEY_WORDS``, ``let``), every one- or two-digit number, and every printable character as a
fallback, each also with a leading space as GPT-2 does (``" bako"``, ``" 48"``). A key is then one
token, a 4-digit value two, and recall is the induction a small model learns quickly.

Any ASCII text still round-trips (``decode(encode(s)) == s``): unknown words fall back to
characters. Built with the ``tokenizers`` library (``WordLevel`` over a ``Split`` pre-tokenizer,
``Fuse`` decoder), wrapped in ``PreTrainedTokenizerFast`` so that
``AutoTokenizer.from_pretrained(path)`` loads it offline. ``<s>`` is prepended; padding is on the
left (batched generation).
"""

from __future__ import annotations

import os
import random
import re

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]

FILLER_WORDS = (
    "the a an of in on at to from with near under over and or but old new small large quiet loud "
    "green blue red dark bright cold warm river stone lamp road house tree field cloud wind rain "
    "bird fish door window garden bridge tower ship market song story kettle letter paper candle "
    "walks holds keeps finds carries watches sings opens turns waits rests grows falls moves"
).split()


def _key_words(n: int = 256) -> list[str]:
    """``n`` pronounceable consonant-vowel-consonant-vowel words, fixed forever by a seed."""
    rng = random.Random("hfkv-testbed-keys")
    cons, vows = "bdfgklmnprstvz", "aeiou"
    pool = sorted({c1 + v1 + c2 + v2 for c1 in cons for v1 in vows for c2 in cons for v2 in vows} - set(FILLER_WORDS))
    return sorted(rng.sample(pool, n))


KEY_WORDS = _key_words()
WORDS = FILLER_WORDS + KEY_WORDS + ["let", "####"]
NUMBERS = [str(i) for i in range(10)] + [f"{i:02d}" for i in range(100)]
CHARS = [chr(c) for c in range(33, 127)]  # printable, space excluded (a token of its own below)

# Longest alternatives first; a word only counts as a word when no letter follows it.
_WORD_ALT = "|".join(sorted((re.escape(w) for w in WORDS), key=len, reverse=True))
PRETOKEN_PATTERN = rf" ?(?:{_WORD_ALT})(?![A-Za-z#])| ?\d\d?| ?[^\s]|\s"
_PRETOKEN = re.compile(PRETOKEN_PATTERN)


def vocab() -> dict[str, int]:
    """Token -> id: special tokens, newline, space, then every unit bare and space-prefixed."""
    units: list[str] = []
    seen: set[str] = set()
    for u in NUMBERS + CHARS + WORDS:
        if u not in seen:
            seen.add(u)
            units.append(u)
    toks = SPECIAL_TOKENS + ["\n", " "] + [t for u in units for t in (u, " " + u)]
    return {tok: i for i, tok in enumerate(toks)}


def pretokenize(text: str) -> list[str]:
    """The pieces the tokenizer maps to ids (one token each); used to count tokens without it."""
    return _PRETOKEN.findall(text)


def count_tokens(text: str) -> int:
    """Number of tokens of ``text`` (without ``<s>``)."""
    return len(_PRETOKEN.findall(text))


def build_tokenizer():
    """Build the tokenizer as a ``transformers.PreTrainedTokenizerFast``."""
    # deferred: keeps hfkv demo --help from importing transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast  # deferred: keeps hfkv demo --help from importing transformers

    v = vocab()
    tok = Tokenizer(models.WordLevel(vocab=v, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PRETOKEN_PATTERN), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, v[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        padding_side="left",
        add_bos_token=True,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )


def save_tokenizer(path: str | os.PathLike) -> None:
    """Write the tokenizer files into ``path`` (created if missing)."""
    os.makedirs(path, exist_ok=True)
    build_tokenizer().save_pretrained(str(path))
