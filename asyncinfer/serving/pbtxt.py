"""A small, strict reader of protobuf's text format, for Triton's ``config.pbtxt``.

It reads the syntax, not a schema: `parse` turns the text into a `Message`, a mapping
of field name to the list of its values in order (a repeated field has several), each value a
`Value` carrying the line it came from. The caller (`.repository`) gives the fields
their meaning and types. Supported: ``name: value`` and ``name { ... }`` / ``name < ... >``
(the colon optional before a message), lists ``name: [v, v]`` and ``name [{...}, {...}]``, strings
in single or double quotes with C escapes (adjacent strings concatenate), integers (decimal,
hex, octal), floats, identifiers (enum values, ``true``/``false``), ``#`` comments and optional
``,``/``;`` separators. Anything else raises `PbtxtError` naming the file and line.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Union

from ..errors import ModelLoadError

Scalar = Union[str, int, float]


class PbtxtError(ModelLoadError):
    """Malformed text format: the message names the file and the line."""


@dataclass
class Identifier:
    """A bare word value: an enum name (``KIND_GPU``) or ``true``/``false``."""

    name: str


@dataclass
class Value:
    """One value of a field: a scalar, an `Identifier`, or a nested `Message`."""

    value: Union[Scalar, Identifier, "Message"]
    line: int


@dataclass
class Message:
    """Fields in order of first appearance, each with every value it was given."""

    fields: dict[str, list[Value]] = field(default_factory=dict)
    line: int = 1

    def add(self, name: str, value: Value) -> None:
        self.fields.setdefault(name, []).append(value)


_TOKEN = re.compile(r"""
    (?P<space>[ \t\r\f\v]+)
  | (?P<newline>\n)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<number>[-+]?(?:0[xX][0-9a-fA-F]+|(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?[fF]?))
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<punct>[{}\[\]<>:,;])
""", re.VERBOSE)

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "a": "\a", "b": "\b", "f": "\f",
            "v": "\v", "?": "?"}
_CLOSE = {"{": "}", "<": ">"}


@dataclass
class _Token:
    kind: str
    text: str
    line: int


def parse(text: str, source: str = "config.pbtxt") -> Message:
    """Parse protobuf text format; ``source`` names the file in error messages."""
    return _Parser(list(_tokens(text, source)), source).message_body(None)


def _tokens(text: str, source: str) -> Iterator[_Token]:
    line, pos = 1, 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise PbtxtError(f"{source}, line {line}: unexpected character {text[pos]!r}")
        kind = match.lastgroup
        assert kind is not None
        if kind == "newline":
            line += 1
        elif kind not in ("space", "comment"):
            yield _Token(kind, match.group(), line)
        pos = match.end()


class _Parser:
    def __init__(self, tokens: list[_Token], source: str):
        self.tokens, self.source, self.pos = tokens, source, 0

    def error(self, message: str, token: _Token | None = None) -> PbtxtError:
        token = token or self.peek()
        line = token.line if token is not None else (self.tokens[-1].line if self.tokens else 1)
        return PbtxtError(f"{self.source}, line {line}: {message}")

    def peek(self) -> _Token | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> _Token:
        token = self.peek()
        if token is None:
            raise self.error("unexpected end of file")
        self.pos += 1
        return token

    def accept(self, text: str) -> bool:
        token = self.peek()
        if token is not None and token.kind == "punct" and token.text == text:
            self.pos += 1
            return True
        return False

    def message_body(self, close: str | None) -> Message:
        start = self.peek()
        message = Message(line=start.line if start is not None else 1)
        while True:
            token = self.peek()
            if token is None:
                if close is not None:
                    raise self.error(f"unexpected end of file: {close!r} expected")
                return message
            if token.kind == "punct" and token.text == close:
                self.pos += 1
                return message
            if token.kind != "ident":
                raise self.error(f"a field name was expected, found {token.text!r}")
            self.pos += 1
            self.field(token, message)
            self.accept(",") or self.accept(";")

    def field(self, name: _Token, message: Message) -> None:
        colon = self.accept(":")
        token = self.peek()
        if token is not None and token.kind == "punct" and token.text == "[":
            self.pos += 1
            if self.accept("]"):
                message.fields.setdefault(name.text, [])
                return
            while True:
                message.add(name.text, self.value(name, scalar_allowed=colon))
                if self.accept("]"):
                    return
                if not self.accept(","):
                    raise self.error(f"',' or ']' expected in the list of {name.text!r}")
        message.add(name.text, self.value(name, scalar_allowed=colon))

    def value(self, name: _Token, scalar_allowed: bool) -> Value:
        token = self.take()
        if token.kind == "punct" and token.text in _CLOSE:
            return Value(self.message_body(_CLOSE[token.text]), token.line)
        if not scalar_allowed:
            raise self.error(f"field {name.text!r}: ':' expected before a value", token)
        if token.kind == "string":
            text = _unquote(token, self)
            while (nxt := self.peek()) is not None and nxt.kind == "string":  # "a" "b" is "ab"
                text += _unquote(self.take(), self)
            return Value(text, token.line)
        if token.kind == "number":
            return Value(_number(token, self), token.line)
        if token.kind == "ident":
            return Value(Identifier(token.text), token.line)
        raise self.error(f"field {name.text!r}: a value was expected, found {token.text!r}", token)


def _number(token: _Token, parser: _Parser) -> int | float:
    text = token.text
    try:
        if re.fullmatch(r"[-+]?0[xX][0-9a-fA-F]+", text):
            return int(text, 16)
        if re.fullmatch(r"[-+]?0[0-7]+", text):
            return int(text, 8)
        if re.fullmatch(r"[-+]?\d+", text):
            return int(text)
        return float(text.rstrip("fF"))
    except ValueError:
        raise parser.error(f"malformed number {text!r}", token) from None


def _unquote(token: _Token, parser: _Parser) -> str:
    body = token.text[1:-1]
    out: list[str] = []
    i = 0
    while i < len(body):
        char = body[i]
        if char != "\\":
            out.append(char)
            i += 1
            continue
        i += 1
        esc = body[i]
        if esc in _ESCAPES:
            out.append(_ESCAPES[esc])
            i += 1
        elif esc in "xX" and re.match(r"[0-9a-fA-F]{1,2}", body[i + 1:]):
            digits = re.match(r"[0-9a-fA-F]{1,2}", body[i + 1:]).group()  # type: ignore[union-attr]
            out.append(chr(int(digits, 16)))
            i += 1 + len(digits)
        elif esc in "01234567":
            digits = re.match(r"[0-7]{1,3}", body[i:]).group()  # type: ignore[union-attr]
            out.append(chr(int(digits, 8)))
            i += len(digits)
        else:
            raise parser.error(f"unknown escape '\\{esc}' in a string", token)
    return "".join(out)
