"""The protocol markers of the chat template in use: text that must never appear inside a message.

Why derived, not listed: what forges a turn depends on the tokenizer and template that render the
SFT set. A message whose content holds ``<|im_end|>\\n<|im_start|>user`` or a
``<tool_response>…</tool_response>`` block is rendered verbatim by the template, so training on it
teaches the model to write tool results and user turns itself. The markers are

* every special token of the tokenizer (``all_special_tokens`` and the added tokens marked special),
  when the model's tokenizer is on disk;
* every tag the template writes around message contents: the template is rendered on a probe
  conversation (system, user, an assistant call, a tool result, an answer) whose contents are
  sentinels, and each ``<...>`` / ``<|...|>`` tag of the output is a marker (the tool-call and
  tool-result tags, the turn delimiters).

:func:`use` sets the markers the audit applies (the validate stage calls it with the configured
model); until then the default is the project's compact template without a tokenizer.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

#: a tag: ``<name>``, ``</name>``, ``<|name|>`` (no spaces inside)
_TAG = re.compile(r"<\|[^\s<>|]+\|>|</?[A-Za-z_][\w.:-]*>")
_SENTINEL = "q9sentinel"

_current: tuple[str, ...] | None = None


def template_text(chat_template: str, tokenizer: Any = None) -> str:
    """The Jinja source of the configured template (``compact``, ``qwen2.5`` or ``model``: the
    tokenizer's own, the compact one when no tokenizer is at hand)."""
    if chat_template == "qwen2.5":
        from trl.chat_template_utils import qwen2_5_chat_template

        return str(qwen2_5_chat_template)
    if chat_template == "model" and tokenizer is not None and isinstance(getattr(tokenizer, "chat_template", None), str):
        return str(tokenizer.chat_template)
    from apprentice.lm.modeling import compact_chat_template

    return compact_chat_template()


def template_markers(template: str) -> frozenset[str]:
    """The tags ``template`` writes around message contents (rendered on a probe conversation
    without tools, so the tool preamble's prose does not count)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    s = _SENTINEL
    conv: list[dict[str, Any]] = [{"role": "system", "content": f"{s}0"}, {"role": "user", "content": f"{s}1"},
            {"role": "assistant", "content": f"{s}2", "tool_calls": [
                {"type": "function", "function": {"name": f"{s}3", "arguments": {f"{s}4": f"{s}5"}}}]},
            {"role": "tool", "name": f"{s}3", "content": f"{s}6"}, {"role": "assistant", "content": f"{s}7"}]
    out: Any = render_jinja_template(conversations=[conv], chat_template=template, add_generation_prompt=True)
    return frozenset(_TAG.findall(str(out[0][0])))


def tokenizer_markers(tokenizer: Any) -> frozenset[str]:
    """The tokenizer's special tokens (named ones and added tokens marked special)."""
    out = {str(t) for t in getattr(tokenizer, "all_special_tokens", []) or []}
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            out.add(str(getattr(tok, "content", tok)))
    return frozenset(t for t in out if t.strip())


@functools.lru_cache(maxsize=8)
def markers_for(model: str = "", chat_template: str = "compact") -> tuple[str, ...]:
    """The markers of ``chat_template`` and, when ``model`` is a local folder with a tokenizer, its
    special tokens; longest first (a report names the whole marker)."""
    tok = None
    if model and Path(model).is_dir():
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model)
        except Exception:  # noqa: BLE001 - no loadable tokenizer: the template's markers still hold
            tok = None
    found = set(template_markers(template_text(chat_template, tok)))
    if tok is not None:
        found |= tokenizer_markers(tok)
    return tuple(sorted(found, key=lambda t: (-len(t), t)))


def use(markers: tuple[str, ...]) -> None:
    """Set the markers the audit applies (the validate stage: the configured model's)."""
    global _current
    _current = tuple(markers)


def markers() -> tuple[str, ...]:
    """The markers in use: those :func:`use` set, else the compact template's."""
    return _current if _current is not None else markers_for("", "compact")
