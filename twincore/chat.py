"""Chat: a conversation rendered through a checkpoint's jinja2 template (sandboxed as ``transformers`` does), and the
generate CLIs' ``--interactive`` loop, which reads a user turn per line and answers each on one kept KV cache.

text = render_template(tok.chat_template, [{"role": "user", "content": "Hi"}], True, "model.gguf")
"""

from __future__ import annotations

import itertools

__all__ = ["render_template", "conversation_ids", "next_turn", "converse", "COMMANDS"]


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


def conversation_ids(tokenizer, template: bool, system: list[dict], exchanges, text: str) -> list[int]:
    """The token ids of a whole conversation: ``system`` (``--system``'s message, or none), each exchange of
    ``exchanges`` (``(user text, reply ids)``) and the user's ``text``.

    With the template, the messages are rendered and encoded whole, each reply as its decoded text (special tokens
    skipped), so the model sees the ids of the whole rendered conversation, as ``generate`` on it would. Without it,
    each user text's ids follow the previous reply's ids (the tokenizer's BOS before the first only)."""
    from .generate import encode_prompt

    if template:
        messages = list(system)
        for user, reply in exchanges:
            messages.append({"role": "user", "content": user})
            messages.append({"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)})
        messages.append({"role": "user", "content": text})
        return encode_prompt(tokenizer, tokenizer.render_chat(messages))
    ids: list[int] = []
    for user, reply in [*exchanges, (text, [])]:
        ids += (tokenizer.encode(user) if ids else encode_prompt(tokenizer, user)) + list(reply)
    return ids


def next_turn(history: list[int], whole: list[int]) -> tuple[list[int], bool]:
    """``(ids, whole)``: the ids a conversation's cache, holding ``history``, appends for the conversation whose ids are
    ``whole`` (:func:`conversation_ids`), and whether they are the whole conversation (the cache must start over).
    A reply whose text encodes to other ids than the ones drawn makes ``whole`` not begin with ``history``; then the
    turn is the whole conversation again."""
    if history and len(whole) > len(history) and whole[: len(history)] == history:
        return whole[len(history) :], False
    return whole, True


# In-chat commands: a line that is exactly one of these (spaces around it aside) is not sent to the model.
COMMANDS = {
    "/reset": "forget the conversation (--system's message stays)",
    "/undo": "forget the last exchange (the user's turn and the reply)",
}


def converse(conversation, tokenizer, args, lines, file=None) -> None:
    """The generate CLIs' ``--interactive``: ``--prompt`` (if given) and then each line of ``lines`` (stdin) is a user
    turn (a line that ends with a backslash continues on the next one); each reply is printed as it is made
    (:func:`twincore.generate.print_stream`), on one ``Conversation``'s KV cache. ``--chat`` renders the turns and
    the replies, after ``--system``'s message, through the checkpoint's template; each turn appends only the ids
    after those the cache holds (:func:`next_turn`). Blank lines are skipped; :data:`COMMANDS` act on the
    conversation. When a turn and its ``max_new_tokens`` would not fit the cache, the oldest exchanges are dropped
    (a note on stderr) and the rest is sent whole, as chat front-ends keep the newest turns; a turn that does not fit
    alone raises the conversation's ValueError (the CLI's one error line). A ring (a windowed model) runs past its
    slots and drops nothing."""
    import sys

    from .generate import FROM_CONFIG, print_stream, system_message

    eos_id = tokenizer.eos_id if tokenizer.eos_id is not None else FROM_CONFIG
    ask = getattr(lines, "isatty", lambda: False)()  # a person typing: a prompt on stderr before each turn
    system = system_message(args)  # --system: the conversation's first message
    exchanges: list[tuple[str, list[int]]] = []  # (user text, reply ids), oldest first
    for line in itertools.chain([args.prompt] if args.prompt is not None else [], _prompted(lines, ask)):
        text = line.rstrip("\r\n")  # --prompt's own; _prompted's lines come without theirs
        if not text.strip():
            continue
        if text.strip() in COMMANDS:
            if text.strip() == "/reset":
                exchanges.clear()
            elif exchanges:
                exchanges.pop()
            conversation.reset()  # the next turn sends what is left whole
            print(f"[{text.strip()}: {len(exchanges)} exchanges kept]", file=sys.stderr)
            continue
        history = conversation.history[0] if conversation.history else []
        ids, whole = next_turn(history, conversation_ids(tokenizer, args.chat, system, exchanges, text))
        dropped = 0
        while exchanges and not conversation.ring and _slots(history, ids, whole, args) > conversation.max_len:
            exchanges.pop(0)
            dropped += 1
            ids, whole = conversation_ids(tokenizer, args.chat, system, exchanges, text), True
        if dropped:
            print(
                f"[dropped the oldest {dropped} of the exchanges to fit --max-len {conversation.max_len}]",
                file=sys.stderr,
            )
        if whole:
            conversation.reset()
        steps = conversation.stream(
            [ids], args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, eos_id
        )
        exchanges.append((text, print_stream(steps, tokenizer, file)))


def _slots(history: list[int], ids: list[int], whole: bool, args) -> int:
    """The cache slots a turn needs (``Conversation``'s rule): what the cache keeps, the turn, and the draws but the
    last (never fed)."""
    return (0 if whole else len(history)) + len(ids) + args.max_new_tokens - 1


def _prompted(lines, ask: bool):
    """Each turn of ``lines``: a line, or lines joined by newlines while each ends with a backslash (the backslash
    dropped), as a shell continues a command; a ``> `` prompt (``. `` for a continued line) on stderr when ``ask``."""
    import sys

    lines = iter(lines)
    while True:
        parts = []
        while True:
            if ask:
                print(". " if parts else "> ", end="", file=sys.stderr, flush=True)
            line = next(lines, None)
            if line is None:
                if parts:
                    yield "\n".join(parts)
                return
            line = line.rstrip("\r\n")
            if not line.endswith("\\"):
                break
            parts.append(line[:-1])
        yield "\n".join([*parts, line])
