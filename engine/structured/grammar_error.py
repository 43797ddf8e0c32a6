"""llguidance's refusal of a grammar, reduced to the one line a client reads.

llguidance reports a bad regex the way Rust's ``regex`` crate does: the
pattern on one line, a caret under the offending characters on the next,
then ``error: <what>``; and it quotes the grammar's source line with a caret
under the position. Flattened onto one line, those carets point at nothing.
``readable_error`` keeps what the carets meant: the pattern, what is wrong and
its offset (characters into the pattern), and llguidance's ``at LINE(COL)``
where the position is in text the client wrote (not for a regex, which
llguidance wraps in a one-line grammar of its own: ``start: /PATTERN/``).
"""

from __future__ import annotations

import re

from nanoserve.engine.structured.constraint import ConstraintKind

# Rust regex's report: "regex parse error:", the pattern indented 4, the caret line, "error: WHAT"
_REGEX_REPORT = re.compile(r"regex parse error:\n {4}(?P<pattern>.*)\n {4}(?P<caret> *\^+)\n *error: (?P<what>[^\n]*)")
# what llguidance says before the report: 'invalid regex "PATTERN" (in regex): ' (the pattern again)
_REGEX_PREFIX = re.compile(r'invalid regex ".*" \(in [^)]*\): $', re.DOTALL)
# llguidance's quote of the grammar's source: "   3 | line text", then a caret line
_SOURCE_QUOTE = re.compile(r"^ *\d+ \| .*$|^ *\^+ *$")
# the position llguidance puts first: "at 1(8): "
_POSITION = re.compile(r"^at \d+\(\d+\): ")
MAX_ERROR_CHARS = 400


def readable_error(message: str, kind: ConstraintKind) -> str:
    """llguidance's (multi-line) error ``message`` for a grammar of ``kind`` as one line of at most
    MAX_ERROR_CHARS characters, e.g. ``invalid regex "[0-9": unclosed character class at offset 0``."""
    report = _REGEX_REPORT.search(message)
    if report is not None:
        offset = len(report["caret"]) - len(report["caret"].lstrip(" "))
        before = _REGEX_PREFIX.sub("", message[: report.start()])
        essential = f'invalid regex "{report["pattern"]}": {report["what"]} at offset {offset}'
        message = before + essential + message[report.end() :]
    lines = [line.strip() for line in message.splitlines() if line.strip() and not _SOURCE_QUOTE.match(line)]
    text = " ".join(lines) or "does not compile"
    if kind is ConstraintKind.REGEX:  # the position is in llguidance's wrapper, not in the client's pattern
        text = _POSITION.sub("", text)
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."
