"""What a structured-output request constrains its output to: one grammar, named by its kind.

The engine's one constraint type, carried on ``SamplingParams.constraint``.
Kinds follow vLLM's ``StructuredOutputsParams`` (and the smg / vLLM gRPC
contract's ``SamplingParams.constraint`` oneof): a JSON schema, a regular
expression, a Lark grammar as llguidance takes it, a list of choices, any
JSON object, or a structural tag. This module checks the shape only (the
text is there, the schema is JSON, the choice list is not empty); whether a
grammar compiles is ``GrammarCompiler``'s question.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from nanoserve.engine.errors import InvalidRequestError

MAX_CONSTRAINT_CHARS = 256 * 1024  # longest schema / regex / grammar text
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 4096


class ConstraintKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"  # text: a JSON Schema document
    REGEX = "regex"  # text: a regular expression (Rust regex syntax), matched whole
    GRAMMAR = "grammar"  # text: a Lark grammar (llguidance's dialect) or GBNF
    CHOICE = "choice"  # choices: the output is exactly one of them
    JSON_OBJECT = "json_object"  # any JSON object; text unused
    STRUCTURAL_TAG = "structural_tag"  # text: llguidance's / vLLM's structural-tag JSON


@dataclass(frozen=True)
class Constraint:
    """One output grammar. ``text`` holds the kind's source ("" for choice and json_object);
    ``choices`` the choice list (empty for every other kind).

    Raises InvalidRequestError naming ``constraint.<kind>`` and what is wrong:
    empty text, text over MAX_CONSTRAINT_CHARS, a schema that is not JSON or
    not an object, an empty choice list or an empty choice.
    """

    kind: ConstraintKind
    text: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", ConstraintKind(self.kind))
        except ValueError:
            kinds = ", ".join(kind.value for kind in ConstraintKind)
            raise InvalidRequestError("constraint", f"unknown kind {self.kind!r} (one of {kinds})") from None
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind is ConstraintKind.CHOICE:
            self._check_choices()
        elif self.kind is not ConstraintKind.JSON_OBJECT:
            self._check_text()

    @property
    def field(self) -> str:
        """The request field an error about this constraint names: ``constraint.json_schema``, ..."""
        return f"constraint.{self.kind.value}"

    def schema(self) -> dict[str, Any]:
        """The JSON schema (json_schema) or structural tag (structural_tag), parsed."""
        parsed = json.loads(self.text)
        assert isinstance(parsed, dict), "checked in __post_init__"
        return parsed

    def to_dict(self) -> dict[str, Any]:
        """The journal's form: {"kind", "text", "choices"} (``from_dict`` reads it back)."""
        return {"kind": self.kind.value, "text": self.text, "choices": list(self.choices)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Constraint:
        return cls(ConstraintKind(data["kind"]), data.get("text", ""), tuple(data.get("choices", ())))

    def _check_text(self) -> None:
        if not isinstance(self.text, str) or not self.text:
            raise InvalidRequestError(self.field, "is empty")
        if len(self.text) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequestError(self.field, f"at most {MAX_CONSTRAINT_CHARS} characters, got {len(self.text)}")
        if self.kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.STRUCTURAL_TAG):
            try:
                parsed = json.loads(self.text)
            except ValueError as exc:
                raise InvalidRequestError(self.field, f"is not valid JSON: {exc}") from None
            if not isinstance(parsed, dict) and not (self.kind is ConstraintKind.JSON_SCHEMA and parsed is True):
                raise InvalidRequestError(self.field, f"must be a JSON object, got {type(parsed).__name__}")

    def _check_choices(self) -> None:
        if not self.choices:
            raise InvalidRequestError(self.field, "is an empty list (give at least one choice)")
        if len(self.choices) > MAX_CHOICES:
            raise InvalidRequestError(self.field, f"at most {MAX_CHOICES} choices, got {len(self.choices)}")
        for index, choice in enumerate(self.choices):
            if not isinstance(choice, str) or not choice:
                raise InvalidRequestError(f"{self.field}[{index}]", f"must be a non-empty string, got {choice!r}")
            if len(choice) > MAX_CHOICE_CHARS:
                raise InvalidRequestError(
                    f"{self.field}[{index}]", f"at most {MAX_CHOICE_CHARS} characters, got {len(choice)}"
                )
