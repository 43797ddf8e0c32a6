"""ChatTemplate: a model's Jinja chat template, rendered as Hugging Face chat templates expect.

Chat templates are written for transformers' renderer, which the template text relies on:
Jinja in a sandbox that lets a template change none of the objects it is given
(``ImmutableSandboxedEnvironment``), with ``trim_blocks`` and ``lstrip_blocks``, the loop
controls (``{% break %}``, ``{% continue %}``), a ``{% generation %}`` tag that marks the
assistant's text, and these names: ``raise_exception(message)``, ``strftime_now(format)``,
``namespace(...)`` (no attribute named with a leading underscore), ``dict(...)`` and the
``tojson`` filter (JSON as ``json.dumps`` writes it: no HTML escaping, non-ASCII kept).
The variables are ``messages``, ``add_generation_prompt``, ``tools`` and ``documents``
(None here) and the tokenizer's named special tokens (``bos_token``, ``eos_token``, ...).

Rendering it here, with jinja2 alone, keeps transformers (over a second of import) off
the server's start; ``tests/engine/test_chat_template.py`` holds the result equal to
transformers' for each of these features.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils


class ChatTemplate:
    """One compiled template; ``render`` is safe to call from one thread at a time or several.

    special_tokens: named special token -> its text (``{"bos_token": "<|im_start|>", ...}``),
    passed to the template as variables. Raises ``jinja2.TemplateSyntaxError`` for a
    template that does not parse.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens)
        self._template = _environment().from_string(source)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation (messages of ``role`` and ``content``) as the model's prompt text.

        Raises ``jinja2.TemplateError`` when the template refuses the conversation
        (its ``raise_exception``) or fails on it.
        """
        # fresh dicts, without the keys whose value is None (as transformers passes them)
        plain = [{key: value for key, value in message.items() if value is not None} for message in messages]
        return self._template.render(
            messages=plain,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %} ... {% endgeneration %}``: renders its body as is (only a training mask reads the mark)."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain set attribute)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` that refuses attributes named with a leading underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's own signature: self may be a keyword
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, and nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a template may not set the namespace attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env
