"""A tiny character-level tokenizer for tests and the CPU example (built locally, no download).

One token per character of a fixed alphabet (digits, arithmetic operators, letters, basic
punctuation, space and newline), plus special tokens and chat-role markers; under 128 ids.
It is a ``transformers.PreTrainedTokenizerFast`` with a chat template, saved with
``save_pretrained`` so ``AutoTokenizer.from_pretrained(out_dir)`` loads it offline.
"""

from __future__ import annotations

import string
from typing import Optional

__all__ = ["build_char_tokenizer", "CHAR_VOCAB", "SPECIAL_TOKENS", "CHAT_TEMPLATE"]

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK) + ROLE_TOKENS
CHAR_VOCAB = tuple(string.digits) + tuple("+-*/=()<>") + (" ",) + tuple(string.ascii_letters) + tuple(".,?:!'\"\n_")

# Each message is "<|role|>content<eos>"; the generation prompt opens an assistant turn, so a
# response ends with <eos> (the stop token).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def _vocab() -> dict[str, int]:
    tokens = list(SPECIAL_TOKENS) + list(CHAR_VOCAB)
    assert len(set(tokens)) == len(tokens)
    return {tok: i for i, tok in enumerate(tokens)}


def build_char_tokenizer(out_dir: Optional[str] = None, model_max_length: int = 4096):
    """Build the character tokenizer; save it to ``out_dir`` when given. Returns it.

    Unknown characters map to ``<unk>``; ``decode`` concatenates characters (no spaces added).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=_vocab(), unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS), model_max_length=model_max_length,
        padding_side="left", clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        tokenizer.save_pretrained(out_dir)
    return tokenizer
