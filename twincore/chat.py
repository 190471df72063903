"""Chat templates: a conversation rendered through a checkpoint's jinja2 template, sandboxed as ``transformers`` does.

text = render_template(tok.chat_template, [{"role": "user", "content": "Hi"}], True, "model.gguf")
"""

from __future__ import annotations

__all__ = ["render_template"]


def render_template(template: str | None, messages, add_generation_prompt: bool, where: str) -> str:
    """``messages`` through ``template``; ValueError naming ``where`` when it has none."""
    if not template:
        raise ValueError(f"--chat needs a chat template; {where} has none")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt)
