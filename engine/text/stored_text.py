"""Text a request hands to the event log: checked where it enters, so the store never refuses it.

A request id and a cache salt are stored as text in the log (the journal, the
REGISTER records); PostgreSQL refuses a NUL in a text field, and a control
character or a lone surrogate (a str that is not valid UTF-8) is no id an
operator can read back. So both are refused on arrival, before anything is
queued, with the field and the rule named:

- 1..``max_chars`` characters (Python ``str`` length: code points);
- no control character (Unicode category Cc: C0, DEL, C1; NUL among them);
- no surrogate code point (category Cs: it has no UTF-8 encoding).

Other characters, spaces and non-ASCII letters included, are accepted.
"""

from __future__ import annotations

import unicodedata

from nanoserve.engine.errors import InvalidRequestError

__all__ = ["check_stored_text"]

# Unicode categories refused: control characters, surrogates
_REFUSED_CATEGORIES = {"Cc": "control character", "Cs": "surrogate (not valid UTF-8)"}


def check_stored_text(field: str, value: object, max_chars: int) -> str:
    """``value`` when it is a str of 1..``max_chars`` printable characters; else InvalidRequestError
    naming ``field``, the limit, and the first refused character with its index."""
    if type(value) is not str or not value:
        raise InvalidRequestError(field, f"must be a non-empty string, got {_shown(value)}")
    if len(value) > max_chars:
        raise InvalidRequestError(field, f"at most {max_chars} characters, got {len(value)}")
    if not value.isprintable():  # fast path: printable text holds no Cc or Cs character
        for index, char in enumerate(value):
            what = _REFUSED_CATEGORIES.get(unicodedata.category(char))
            if what is not None:
                raise InvalidRequestError(
                    field, f"must hold no control characters or surrogates: {what} U+{ord(char):04X} at index {index}"
                )
    return value


def _shown(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."
