"""One row of the settings table (``settings.SETTINGS``): its flag, environment variable, parser,
default and help, and the parsers its values are read with (flags and variables alike).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "NANOSERVE_"


def parse_optional_int(text: str) -> int | None:
    return None if text.lower() in ("", "none", "off") else int(text)


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


def parse_bytes(text: str) -> int:
    """``1073741824``, ``512MiB``, ``2GiB``, ``4GB`` -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lowered = text.strip().lower()
    for suffix, factor in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * factor)
    return int(lowered)


def parse_optional_bytes(text: str) -> int | None:
    return None if text.lower() in ("", "none", "auto") else parse_bytes(text)


# a parser -> what its values look like, for the message that refuses a NANOSERVE_* variable's value
EXPECTED_VALUES: dict[Callable[[str], Any], str] = {
    int: "an integer",
    float: "a number",
    parse_optional_int: "an integer, or none/off",
    parse_bool: "a boolean (1/0, true/false, yes/no, on/off)",
    parse_bytes: "a byte count (1073741824, 512MiB, 2GiB, 4GB)",
    parse_optional_bytes: "a byte count (1073741824, 512MiB, 2GiB, 4GB), or auto/none",
}


@dataclass(frozen=True)
class Setting:
    """One setting: flag ``--name-with-dashes``, env ``NANOSERVE_NAME``."""

    name: str
    layer: str  # "server" or "engine"
    parse: Callable[[str], Any]
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    default_help: str | None = None  # what the default means, where its value alone does not say

    @property
    def shown_default(self) -> str:
        """The default as --help shows it."""
        if self.default_help is not None:
            return self.default_help
        return "none" if self.default is None else str(self.default)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def expected(self) -> str:
        """What a value of this setting looks like (its type), in words."""
        return EXPECTED_VALUES.get(self.parse, "text")
