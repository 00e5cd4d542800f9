"""Character-level tokenizer of the testbed model.

One token per character: the vocabulary is ``<pad> <s> </s> <unk>``, the newline and the 95
printable ASCII characters (space to ``~``), 100 tokens in all. It is built with the
``tokenizers`` library (a ``WordLevel`` model over single characters, a pre-tokenizer that
isolates every character and a ``Fuse`` decoder that joins them back without spaces), wrapped in
``transformers.PreTrainedTokenizerFast`` and saved with ``save_pretrained``, so that
``AutoTokenizer.from_pretrained(path)`` loads it offline and ``decode(encode(s)) == s`` for any
string over the vocabulary. ``<s>`` is prepended to every encoded sequence; padding is on the
left (batched generation).
"""

from __future__ import annotations

import os

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]


def vocab() -> dict[str, int]:
    """Token -> id: the four special tokens first, then the characters."""
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}


def build_tokenizer():
    """Build the character tokenizer as a ``transformers.PreTrainedTokenizerFast``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    v = vocab()
    tok = Tokenizer(models.WordLevel(vocab=v, unk_token=UNK))
    # Every character (newline included) is its own pre-token; nothing is normalized or dropped.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, v[BOS])]
    )
    fast = PreTrainedTokenizerFast(
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
    return fast


def save_tokenizer(path: str | os.PathLike) -> None:
    """Write the tokenizer files into ``path`` (created if missing)."""
    os.makedirs(path, exist_ok=True)
    build_tokenizer().save_pretrained(str(path))
