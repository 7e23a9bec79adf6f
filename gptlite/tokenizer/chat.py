"""Conversations: a list of {"role": "system" | "user" | "assistant", "content": str} messages rendered with a chat
template, as transformers renders them (jinja2's ImmutableSandboxedEnvironment, trim_blocks and lstrip_blocks,
loop controls, the tojson filter, raise_exception and strftime_now), and where in the rendered text each assistant
turn lies (its content and its end-of-turn marker: what fine-tuning on conversations learns to predict).

A tokenizer without a template of its own gets gptlite's default, ChatML (<|im_start|>role\\ncontent<|im_end|>\\n),
whose two markers are special tokens (see Tokenizer.apply_chat_template).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache

ROLES = ("system", "user", "assistant")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def check_messages(messages, where: str = "the conversation") -> list[dict]:
    """The messages as plain dicts, or a ValueError naming `where` and what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"{where}: messages must be a non-empty list of {{'role', 'content'}} objects, got {str(messages)[:80]}"
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i + 1} must be an object with a string 'content', got {str(m)[:80]}")
        if m.get("role") not in ROLES:
            raise ValueError(f"{where}: message {i + 1} has role {m.get('role')!r}; use one of {', '.join(ROLES)}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


@lru_cache(maxsize=16)
def compile_template(template: str):
    """A chat template compiled in jinja2's sandbox, with what transformers' templates may use."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """{% generation %}...{% endgeneration %} (transformers' assistant-mask tags): the body, as it is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(
            f"the chat template is not valid jinja ({e}); fix it in chat_template.jinja or tokenizer_config.json"
        ) from None


def render(
    template: str, messages: list[dict], add_generation_prompt: bool = False, special: dict | None = None
) -> str:
    """The conversation as the template writes it; a template that fails is one ValueError with its message."""
    import jinja2

    try:
        return compile_template(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=None,
            documents=None,
            **(special or {}),
        )
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the chat template failed to render this conversation: {e}") from None


def assistant_spans(
    template: str, messages: list[dict], special: dict | None, ends: Sequence[str]
) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the character span of every assistant turn: its content and end-of-turn
    marker). A turn's span runs from where the template, asked for a generation prompt after the messages before
    it, stops, to the end of the rendering that includes it, cut after the last of the end-of-turn markers `ends`
    in it (what the template writes after the marker, such as Gemma's newline, is the next turn's); the template
    must render each conversation as a prefix of the next (templates that rewrite earlier turns are refused)."""
    text = render(template, messages, special=special)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(template, messages[:i], add_generation_prompt=True, special=special)
        through = render(template, messages[: i + 1], special=special)
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(
                "the chat template does not render a conversation as a prefix of its continuation (it "
                "rewrites earlier turns), so the assistant's turns cannot be told apart for training"
            )
        turn = through[len(before) :]
        cuts = [len(before) + turn.rindex(e) + len(e) for e in ends if e and e in turn]
        spans.append((len(before), max(cuts, default=len(through))))
    return text, spans
