"""Chat: a conversation rendered through a checkpoint's jinja2 template (sandboxed as ``transformers`` does), and the
generate CLIs' ``--interactive`` loop, which reads a user turn per line and answers each on one kept KV cache.

text = render_template(tok.chat_template, [{"role": "user", "content": "Hi"}], True, "model.gguf")
"""

from __future__ import annotations

import itertools

__all__ = ["render_template", "next_turn", "converse"]


def render_template(
    template: str | None, messages, add_generation_prompt: bool, where: str, special_tokens: dict | None = None
) -> str:
    """``messages`` through ``template`` with what ``transformers``' ``apply_chat_template`` gives a template: the
    special tokens' text (``special_tokens``: ``bos_token``, ``eos_token``; Llama 3's template writes ``{{ bos_token
    }}`` first), ``raise_exception(message)``, ``strftime_now(format)``, a ``tojson`` that does not escape HTML, and
    ``{% break %}`` / ``{% continue %}``. ValueError naming ``where`` when it has no template or the template
    refuses the conversation (``raise_exception``) or does not parse."""
    if not template:
        raise ValueError(f"--chat needs a chat template; {where} has none")
    import datetime
    import json

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.datetime.now().strftime(f))
    env.filters["tojson"] = tojson
    variables = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    try:
        compiled = env.from_string(template)
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the chat template of {where}: {type(e).__name__}: {e}") from None


def next_turn(history: list[int], messages: list[dict], text: str, tokenizer, template: bool) -> tuple[list[int], bool]:
    """``(ids, whole)``: the token ids a conversation appends for the user's ``text``, and whether they are the whole
    conversation (the cache must start over).

    With the chat template, ``messages`` (the turns so far; this one is appended to it) are rendered and encoded whole,
    and the ids after ``history`` (what the conversation's cache holds) are the turn's: the model sees the ids of the
    whole rendered conversation, as ``generate`` on it would. A reply whose text encodes to other ids than the ones
    drawn makes the encoded conversation not begin with ``history``; then the turn is the whole conversation again.
    Without the template, the turn is ``text``'s ids (after the tokenizer's BOS on the first turn)."""
    from .generate import encode_prompt

    if not template:
        return (tokenizer.encode(text) if history else encode_prompt(tokenizer, text)), False
    messages.append({"role": "user", "content": text})
    ids = encode_prompt(tokenizer, tokenizer.render_chat(messages))
    if history and len(ids) > len(history) and ids[: len(history)] == history:
        return ids[len(history) :], False
    return ids, True


def converse(conversation, tokenizer, args, lines, file=None) -> None:
    """The generate CLIs' ``--interactive``: ``--prompt`` (if given) and then each line of ``lines`` (stdin) is a user
    turn; each reply is printed as it is made (:func:`twincore.generate.print_stream`), on one ``Conversation``'s KV
    cache. ``--chat`` renders the turns and the replies, after ``--system``'s message, through the checkpoint's
    template (:func:`next_turn`); blank lines are skipped. A turn that does not fit the cache raises the
    conversation's ValueError (the CLI's one error line)."""
    from .generate import FROM_CONFIG, print_stream, system_message

    eos_id = tokenizer.eos_id if tokenizer.eos_id is not None else FROM_CONFIG
    ask = getattr(lines, "isatty", lambda: False)()  # a person typing: a prompt on stderr before each turn
    messages = system_message(args)  # --system: the conversation's first message
    for line in itertools.chain([args.prompt] if args.prompt is not None else [], _prompted(lines, ask)):
        text = line.rstrip("\r\n")
        if not text.strip():
            continue
        history = conversation.history[0] if conversation.history else []
        ids, whole = next_turn(history, messages, text, tokenizer, args.chat)
        if whole:
            conversation.reset()
        steps = conversation.stream(
            [ids], args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, eos_id
        )
        reply = print_stream(steps, tokenizer, file)
        if args.chat:
            messages.append({"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)})


def _prompted(lines, ask: bool):
    import sys

    lines = iter(lines)
    while True:
        if ask:
            print("> ", end="", file=sys.stderr, flush=True)
        line = next(lines, None)
        if line is None:
            return
        yield line
