"""Byte tokens: every UTF-8 byte is a token (ids 0-255), 256 ends a document.

What the shipped text and ``--tokenizer bytes`` train on. So that a model
trained this way exports like any other (flatfsdp checkpoint export --format
hf), the same tokenizer is also written out in Hugging Face's own form -- a
byte-level BPE whose vocabulary is the 256 bytes, in byte order, and no merges
-- which ``AutoTokenizer.from_pretrained`` loads and which gives these very
ids. The files are made here, as JSON, so they need no tokenizers package.
"""

from __future__ import annotations

import json
from functools import cache

EOS_TOKEN = "<|endoftext|>"
"""The name id 256 has in the Hugging Face form (GPT-2's name for the document separator)."""


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as one printable character (what
    the ByteLevel pre-tokenizer maps bytes to, and its decoder maps back)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


@cache
def hugging_face_files() -> dict[str, bytes]:
    """tokenizer.json and tokenizer_config.json of the byte tokenizer (the same bytes every time)."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
        "added_tokens": [{"id": 256, "content": EOS_TOKEN, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}],
        "pre_tokenizer": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {char: byte for byte, char in _byte_to_unicode().items()}, "merges": []},
    }
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "model_max_length": 1 << 30,
              "clean_up_tokenization_spaces": False}
    return {name: (json.dumps(value, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode()
            for name, value in (("tokenizer.json", tokenizer), ("tokenizer_config.json", config))}


class ByteTokenizer:
    """Every UTF-8 byte is a token (ids 0-255); 256 ends a document."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256
    bos_id = None
    pad_id = None
    fingerprint = "bytes-v1"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def files(self) -> dict[str, bytes]:
        return hugging_face_files()
