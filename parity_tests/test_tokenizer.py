"""One tokenizer loader for both twins (``twincore.tokenizer``), and ``generate`` stopping at the model's EOS.

``jaxattn.load_tokenizer`` and ``torchref.load_tokenizer`` are the same function; every tokenizer it returns has one
interface; ``from_pretrained`` keeps ``config.json``'s / the GGUF file's EOS id in the model config, and ``generate``
stops there by default in both twins (``eos_id=None`` never stops early).
"""

import dataclasses
import json

import numpy as np
import pytest

from twincore.config import ModelConfig
from twincore.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

INTERFACE = ("encode", "decode", "render_chat", "eos_id", "bos_id", "add_bos", "chat_template", "vocab_size", "name")


def test_both_packages_export_the_one_loader():
    import jaxattn
    import torchref

    assert jaxattn.load_tokenizer is torchref.load_tokenizer is load_tokenizer


def _hf_dir(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {chr(97 + i): i for i in range(26)} | {"<eos>": 26}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(["<eos>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [5, 7], "bos_token_id": 0}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}!"}))
    return tmp_path


def test_every_tokenizer_has_one_interface(tmp_path):
    byte, hf = load_tokenizer(None), load_tokenizer(_hf_dir(tmp_path))
    assert isinstance(byte, ByteTokenizer) and isinstance(hf, HFTokenizer)
    assert isinstance(load_tokenizer(tmp_path / "nope"), ByteTokenizer)  # a directory without tokenizer.json
    for tok in (byte, hf):
        assert all(hasattr(tok, a) for a in INTERFACE), [a for a in INTERFACE if not hasattr(tok, a)]
        ids = tok.encode("abc")
        assert (
            isinstance(ids, list) and all(isinstance(i, int) for i in ids) and tok.decode(ids).replace(" ", "") == "abc"
        )
    assert byte.encode("é") == [0xC3, 0xA9] and byte.eos_id is None and byte.vocab_size == 256
    assert (hf.eos_id, hf.bos_id, hf.vocab_size) == (5, 0, 27)  # the first of config.json's EOS list
    assert hf.render_chat([{"role": "user", "content": "hi"}]) == "hi!"
    with pytest.raises(ValueError, match="--chat needs a chat template; the byte-level tokenizer has none"):
        byte.render_chat([{"role": "user", "content": "hi"}])


def test_config_keeps_the_special_ids_and_refuses_bad_ones():
    cfg = ModelConfig.from_hf({**ModelConfig.preset("tiny").to_hf(), "eos_token_id": [1, 2], "bos_token_id": 0})
    assert cfg.eos_token_id == (1, 2) and cfg.eos_ids == (1, 2) and cfg.bos_token_id == 0
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg and cfg.to_hf()["eos_token_id"] == [1, 2]
    assert ModelConfig.preset("tiny").eos_ids == () and ModelConfig.preset("tiny").to_hf()["eos_token_id"] is None
    for bad in (256, -1, [], [3, "x"], True):
        with pytest.raises(ValueError, match="eos_token_id must be None, a token id in \\[0, 256\\)"):
            dataclasses.replace(ModelConfig.preset("tiny"), eos_token_id=bad)


def test_generate_stops_at_the_config_eos_by_default_in_both_twins(seed):
    import torch

    from benchmarks.twins import twin_models
    from jaxattn import generate as jgen
    from torchref import generate as tgen

    cfg = ModelConfig.preset("tiny")
    tmodel, jmodel = twin_models(cfg, seed=seed)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5]]
    free = tgen.generate(tmodel, prompts, 12)  # a preset knows no EOS: every row runs to max_new_tokens
    assert free == jgen.generate(jmodel, prompts, 12) and all(len(r) == 12 for r in free)
    eos = free[0][4]  # a token row 0 emits at step 4
    expected = [row[: row.index(eos) + 1] if eos in row else row for row in free]
    for model in (tmodel, jmodel):
        model.config = dataclasses.replace(cfg, eos_token_id=eos)
    with torch.no_grad():
        assert tgen.generate(tmodel, prompts, 12) == expected == jgen.generate(jmodel, prompts, 12)
    assert tgen.generate(tmodel, prompts, 12, eos_id=None) == free == jgen.generate(jmodel, prompts, 12, eos_id=None)
    with pytest.raises(ValueError, match="eos_id must be 'config'"):
        jgen.generate(jmodel, prompts, 4, eos_id=[np.int64(300)])


# A template using what transformers' apply_chat_template gives one: the special tokens' text, raise_exception,
# strftime_now, a tojson that keeps "<" and non-ASCII as they are, and {% break %}.
TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{{- '<|start|>' + m['role'] + '\n' + m['content'] | tojson + '<|end|>' }}"
    "{%- if m['role'] == 'assistant' %}{{ eos_token }}{%- endif %}"
    "{%- if loop.index0 == 3 %}{% break %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start|>assistant ' + strftime_now('%Y') + '\n' }}{%- endif %}"
)


def _bos_dir(tmp_path, bos_first: bool):
    """A directory as transformers saves one: tokenizer.json (a BOS-first post-processor or none), the special
    tokens and the chat template in tokenizer_config.json, the ids in config.json."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {chr(97 + i): i for i in range(26)} | {"<s>": 26, "</s>": 27}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(["<s>", "</s>"])
    if bos_first:
        tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 26)])
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 26, "eos_token_id": 27}))
    return tmp_path


@pytest.mark.parametrize("bos_first", [True, False], ids=["bos-post-processor", "none"])
def test_prompts_and_chat_templates_are_transformers(tmp_path, bos_first):
    """A directory's prompt is what transformers' ``tokenizer(text)`` gives (the BOS its post-processor puts first,
    or none), and a chat renders as ``apply_chat_template`` renders it (special tokens' text, ``tojson``,
    ``strftime_now``, ``{% break %}``); a conversation the template refuses (``raise_exception``) is a ValueError
    naming the directory and the template's message."""
    transformers = pytest.importorskip("transformers")
    from twincore.generate import encode_prompt

    path = _bos_dir(tmp_path, bos_first)
    ours, ref = HFTokenizer(str(path)), transformers.AutoTokenizer.from_pretrained(str(path))
    assert ours.add_bos is bos_first
    for text in ("abc", "hello", "</s>xyz"):
        assert encode_prompt(ours, text) == ref(text).input_ids, text
    chat = [
        {"role": "user", "content": "is 1 < 2 in «français»?"},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "and then"},
        {"role": "assistant", "content": "no"},
        {"role": "user", "content": "cut by the break"},
    ]
    for n in (1, 3, 5):
        expected = ref.apply_chat_template(chat[:n], tokenize=False, add_generation_prompt=True)
        assert ours.render_chat(chat[:n]) == expected
    assert ours.render_chat(chat[:2]).startswith('<s><|start|>user\n"is 1 < 2 in «français»?"')
    with pytest.raises(ValueError, match=r"tokenizer\.json's directory: TemplateError: Conversation roles must alt"):
        ours.render_chat([{"role": "assistant", "content": "hi"}])
