"""Chat messages to a prompt: the model's chat template, or a plain fallback.

A model folder's ``tokenizer_config.json`` usually carries its ``chat_template`` (Jinja). With
``jinja2`` installed (the ``text`` extra), messages are rendered with it in a sandboxed
environment, as transformers renders them: ``messages``, ``add_generation_prompt=True``, the
special tokens (``bos_token``, ``eos_token``…) and ``raise_exception``. Without a template, or
without jinja2, the **plain fallback** writes one ``role: content`` line per message and ends
with ``assistant:``, which any base model can continue.
"""
from __future__ import annotations

import datetime
import functools
import importlib.util
import logging
from collections.abc import Sequence
from typing import Any

from ..runtime.generation.text import TextTokenizer
from .protocol import ProtocolError

ROLES = ("system", "developer", "user", "assistant", "tool")
logger = logging.getLogger(__name__)


class TemplateError(Exception):
    """The template called ``raise_exception``: the conversation does not fit it (the client's fault)."""


def messages_of(value: Any) -> list[dict[str, Any]]:
    """The chat ``messages`` of a request, checked: ``[{"role", "content"}]`` with text content
    (a string, or a list of ``{"type": "text", "text": ...}`` parts, joined). ProtocolError 400."""
    if not isinstance(value, list) or not value:
        raise ProtocolError(400, "'messages' must be a non-empty array of {role, content} objects")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise ProtocolError(400, f"messages[{i}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ProtocolError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r:.40}")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ProtocolError(400, f"messages[{i}].content: only text parts "
                                             "({\"type\": \"text\", \"text\": ...}) are supported")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise ProtocolError(400, f"messages[{i}].content must be a string or an array of text parts")
        if message.get("tool_calls"):
            raise ProtocolError(400, f"messages[{i}]: tool calls are not supported")
        entry = {"role": role, "content": content}
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        messages.append(entry)
    return messages


def render(messages: Sequence[dict[str, Any]], tokenizer: TextTokenizer | None) -> tuple[str, bool]:
    """The prompt of ``messages``, and whether it came from the model's template (its text then
    holds the special tokens: encode it without adding more).

    Raises:
        ProtocolError: 400 when the template refuses the conversation (``raise_exception``);
            500 when the template itself is broken.
    """
    template = tokenizer.chat_template if tokenizer is not None else None
    if template is not None and importlib.util.find_spec("jinja2") is not None:
        assert tokenizer is not None
        try:
            return _compiled(template).render(messages=list(messages), add_generation_prompt=True,
                                              **tokenizer.special_tokens), True
        except TemplateError as exc:
            raise ProtocolError(400, f"the model's chat template refused the messages: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a broken template is the server's problem, not the client's
            logger.exception("the chat template of %s failed", tokenizer.source)
            raise ProtocolError(500, f"the model's chat template failed ({type(exc).__name__}: {exc})") from None
    if template is not None:
        _warn_no_jinja()
    return plain(messages), False


def prepare(tokenizer: TextTokenizer) -> None:
    """Compile the tokenizer's chat template now (a helper thread), not at the first request;
    a broken template is reported when rendered."""
    if tokenizer.chat_template is not None and importlib.util.find_spec("jinja2") is not None:
        try:
            _compiled(tokenizer.chat_template)
        except Exception:  # noqa: BLE001 - the first chat request answers 500 with the reason
            logger.exception("the chat template of %s does not compile", tokenizer.source)


def plain(messages: Sequence[dict[str, Any]]) -> str:
    """The fallback prompt: ``role: content`` lines, then ``assistant:``."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(template)


@functools.lru_cache(maxsize=1)
def _warn_no_jinja() -> None:
    logger.warning("a model has a chat template but jinja2 is not installed (pip install 'asyncinfer[text]'): "
                   "chat messages use the plain 'role: content' fallback")
