"""The model's chat template around a RULER prompt, as RULER wraps its task template in the model's
template (prepare.py line 101, template.py: e.g. 'meta-llama3' = the Llama 3 chat format) and puts the
answer prefix after it, at the start of the assistant's turn.

The template is the tokenizer's own (Jinja, the Hugging Face convention: `messages`,
`add_generation_prompt`, `bos_token`, ...), rendered here as transformers' apply_chat_template renders
it (a sandboxed Jinja environment with trim_blocks and lstrip_blocks, `raise_exception`, json `tojson`);
`strftime_now` returns a fixed date (_DATE), so a template that prints today's date still gives the
same prompts every day. The user's text is rendered as a placeholder and split out, so the prompt is
composed in token space around it.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import Optional

from ..prompts import EvalError

_SLOT = "\ue000megablu-ruler-user-text\ue001"
_DATE = datetime.datetime(2024, 7, 26)


def _render(template: str, messages: list[dict], tokens: dict) -> str:
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _DATE.strftime
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True, **tokens)
    except TemplateError as e:
        raise EvalError(
            f"the tokenizer's chat template failed to render a RULER prompt ({e}); set "
            f"eval.chat_template: off to evaluate on plain text"
        ) from None


class Chat:
    """eval.chat_template resolved for one tokenizer: `on` is whether prompts are wrapped."""

    def __init__(self, tokenizer, mode: str, task: str):
        template: Optional[str] = getattr(tokenizer, "chat_template", None)
        if mode not in ("auto", "on", "off"):
            raise EvalError(f"eval.chat_template={mode!r}: expected auto, on or off")
        if mode == "on" and not template:
            raise EvalError(
                f"eval.chat_template=on but tokenizer {tokenizer.identity} has no chat template (task "
                f"{task}); give it one (chat_template.jinja or tokenizer_config.json's chat_template "
                f"beside tokenizer.json), or set eval.chat_template: auto (plain text for a tokenizer "
                f"without one) or off"
            )
        self.on = bool(template) and mode != "off"
        self.template = template
        self.tokens = dict(getattr(tokenizer, "template_tokens", {}) or {})

    def around(self, turns: Sequence[tuple[str, str]] = ()) -> tuple[str, str]:
        """(text before, text after) the final user message, after the earlier `turns` ((role, content),
        e.g. cwe's worked example as a user and an assistant turn); ('', '') when off."""
        if not self.on or self.template is None:  # on implies a template
            return "", ""
        msgs = [{"role": r, "content": c} for r, c in turns] + [{"role": "user", "content": _SLOT}]
        text = _render(self.template, msgs, self.tokens)
        if text.count(_SLOT) != 1:
            raise EvalError(
                "the tokenizer's chat template does not show the user's message verbatim once; set "
                "eval.chat_template: off to evaluate on plain text"
            )
        before, after = text.split(_SLOT)
        return before, after
