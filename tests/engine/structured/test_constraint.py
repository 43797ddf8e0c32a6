"""A Constraint checks its shape: each bad input names constraint.<kind> and what is wrong."""

from __future__ import annotations

import pytest

from nanoserve.engine.errors import InvalidRequestError
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.structured.constraint import MAX_CHOICES, Constraint, ConstraintKind


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "json_schema", "text": "{not json"}, "constraint.json_schema: is not valid JSON: Expecting"),
        ({"kind": "json_schema", "text": "[1, 2]"}, "constraint.json_schema: must be a JSON object, got list"),
        ({"kind": "regex", "text": ""}, "constraint.regex: is empty"),
        ({"kind": "choice", "choices": ()}, "constraint.choice: is an empty list (give at least one choice)"),
        ({"kind": "choice", "choices": ("a", "")}, "constraint.choice[1]: must be a non-empty string, got ''"),
        (
            {"kind": "choice", "choices": ("a",) * (MAX_CHOICES + 1)},
            f"constraint.choice: at most {MAX_CHOICES} choices",
        ),
        ({"kind": "xml"}, "constraint: unknown kind 'xml' (one of json_schema, regex, grammar, choice"),
    ],
)
def test_bad_constraint_names_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        Constraint(**kwargs)
    assert str(caught.value).startswith(message)


def test_json_object_needs_no_text() -> None:
    assert Constraint("json_object") == Constraint(ConstraintKind.JSON_OBJECT, "", ())


def test_journal_form_round_trips_through_sampling_params() -> None:
    constraint = Constraint("choice", choices=["yes", "no"])
    assert constraint.to_dict() == {"kind": "choice", "text": "", "choices": ["yes", "no"]}
    params = SamplingParams(constraint=constraint.to_dict())  # type: ignore[arg-type]  # the journal's dict
    assert params.constraint == Constraint(ConstraintKind.CHOICE, "", ("yes", "no"))


def test_sampling_params_refuse_a_constraint_of_another_type() -> None:
    with pytest.raises(InvalidRequestError, match=r"^constraint: must be a Constraint or None, got str$"):
        SamplingParams(constraint="[0-9]+")  # type: ignore[arg-type]
