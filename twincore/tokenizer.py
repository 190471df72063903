"""A checkpoint's tokenizer, one loader for both twins: training data, evaluation, generation and users.

    tok = load_tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf")     # also jaxattn.load_tokenizer, torchref.load_tokenizer
    ids = tok.encode(tok.render_chat([{"role": "user", "content": "Hi"}]))   # list[int]; tok.decode(ids) -> str
    tok.eos_id, tok.bos_id, tok.vocab_size                                   # what generate() stops at by default

:func:`load_tokenizer` takes what ``--init`` / ``from_pretrained`` take: a llama.cpp ``.gguf`` file (its metadata's
BPE tokenizer, ``twincore.gguf.GGUFTokenizer``), a Hugging Face directory with ``tokenizer.json`` (:class:`HFTokenizer`:
``tokenizer_config.json``'s chat template, the EOS / BOS ids of ``generation_config.json`` or ``config.json``, and
``add_bos`` where its post-processor puts the BOS first, as ``tokenizer(text)`` would), or
anything else (None, a directory without one) for :class:`ByteTokenizer`, raw UTF-8 bytes as ids 0..255, the
trainers' default. Every tokenizer has the same interface: ``encode(text)`` (no special tokens added; special tokens
written in the text, such as ``<|im_start|>``, become their ids), ``decode(ids, skip_special_tokens=False)``,
``render_chat(messages)``, ``eos_id``, ``bos_id``, ``add_bos``, ``chat_template``, ``vocab_size`` and ``name``.
The text itself goes through Hugging Face's ``tokenizers`` library; nothing here tokenizes by hand.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from .chat import render_template

__all__ = ["TOKENIZER_FILE", "ByteTokenizer", "HFTokenizer", "load_tokenizer", "is_gguf"]

TOKENIZER_FILE = "tokenizer.json"


def is_gguf(path) -> bool:
    """True for a path naming a llama.cpp ``.gguf`` file."""
    return path is not None and str(path).endswith(".gguf") and os.path.isfile(path)


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; no special tokens (the trainers separate documents by segment ids)."""

    vocab_size = 256
    name = "bytes"
    bos_id = eos_id = None
    add_bos = False
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def render_chat(self, messages, add_generation_prompt: bool = True) -> str:
        return render_template(None, messages, add_generation_prompt, "the byte-level tokenizer")


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None


def _first(value):
    return value[0] if isinstance(value, list) and value else (None if isinstance(value, list) else value)


class HFTokenizer:
    """A Hugging Face directory's ``tokenizer.json`` (or that file itself) with its chat template and special ids."""

    add_bos = False  # see __init__: whether tokenizer.json's post-processor puts a BOS first

    def __init__(self, path: str):
        from tokenizers import Tokenizer  # optional dependency: only needed when a tokenizer.json is given

        file = path if os.path.isfile(path) else os.path.join(path, TOKENIZER_FILE)
        folder = os.path.dirname(file)
        try:
            self.tokenizer = Tokenizer.from_file(file)
        except Exception as e:  # tokenizers raises its own Exception type
            raise ValueError(f"{file} is not a readable tokenizer.json ({str(e)[:200]})") from None
        ids = {
            **_read_json(os.path.join(folder, "config.json")),
            **_read_json(os.path.join(folder, "generation_config.json")),
        }
        self.eos_id, self.bos_id = _first(ids.get("eos_token_id")), _first(ids.get("bos_token_id"))
        config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        self.chat_template = config.get("chat_template")
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.name = file
        # encode() adds no special token; a prompt gets the BOS that `tokenizer(text)` would give it (Llama 3's
        # post-processor writes <|begin_of_text|> first; SmolLM2's writes nothing), through add_bos
        first = self.tokenizer.encode("", add_special_tokens=True).ids[:1]
        self.add_bos = self.bos_id is not None and first == [self.bos_id]
        self.special_tokens = {}  # the text of tokenizer_config.json's bos / eos tokens, for the chat template
        for key, i in (("bos_token", self.bos_id), ("eos_token", self.eos_id)):
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            self.special_tokens[key] = (
                value if isinstance(value, str) else (None if i is None else self.tokenizer.id_to_token(int(i)))
            )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages, add_generation_prompt: bool = True) -> str:
        where = f"{self.name}'s directory"
        return render_template(self.chat_template, messages, add_generation_prompt, where, self.special_tokens)


def load_tokenizer(path: str | os.PathLike | None = None):
    """The tokenizer of a checkpoint path (see the module docstring): a ``.gguf`` file's, a directory's
    ``tokenizer.json``, else :class:`ByteTokenizer`."""
    if path is not None:
        path = os.fspath(path)
    if is_gguf(path):
        from .gguf import read_gguf_tokenizer

        return read_gguf_tokenizer(path)
    if path is not None and os.path.isfile(os.path.join(path, TOKENIZER_FILE)):
        return HFTokenizer(path)
    return ByteTokenizer()
