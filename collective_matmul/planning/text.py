"""Bounded text: the two kinds of free text the wire contract carries, each defined once.

- a *label* (`label`): one line, such as a name, a key, a role or a version: no control character
  (U+0000-U+001F, U+007F);
- a *message* (`message`): what a worker or the engine says about a result: tabs and line breaks
  allowed, no other control character.

Both carry a length bound: where a field is stored in a database column, the column's width.  The
patterns are part of the OpenAPI document, so a client knows them.  Producers of text they do not
control (an exception's message, a file name) pass it through `as_label` or `as_message` first.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import StringConstraints

LABEL_PATTERN = r"^[^\x00-\x1f\x7f]*$"
MESSAGE_PATTERN = r"^[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f]*$"
_NOT_IN_LABEL = re.compile(r"[\x00-\x1f\x7f]")
_NOT_IN_MESSAGE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def label(max_length: int, *, min_length: int = 1) -> Any:
    """The type of a one-line label of ``min_length`` to ``max_length`` characters."""
    return Annotated[str, StringConstraints(min_length=min_length, max_length=max_length, pattern=LABEL_PATTERN)]


def message(max_length: int) -> Any:
    """The type of a message of at most ``max_length`` characters (tabs and line breaks allowed)."""
    return Annotated[str, StringConstraints(max_length=max_length, pattern=MESSAGE_PATTERN)]


def as_label(text: str) -> str:
    """``text`` on one line: each control character replaced by ``?`` (the length is the caller's)."""
    return _NOT_IN_LABEL.sub("?", text)


def as_message(text: str, max_length: int) -> str:
    """``text`` as a valid `message`: each control character but tab and line breaks replaced by ``?``, and
    cut to ``max_length`` characters (ending in `` ...`` where it was cut)."""
    text = _NOT_IN_MESSAGE.sub("?", text)
    return text if len(text) <= max_length else text[:max_length - 4] + " ..."
