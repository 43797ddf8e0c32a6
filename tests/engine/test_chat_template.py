"""ChatTemplate renders Hugging Face chat templates to the text transformers renders."""

from __future__ import annotations

import jinja2
import pytest

from nanoserve.engine.chat_template import ChatTemplate

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": 'Say "hi" <b>& 東京</b>'},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "Again?"},
]
# each template leans on one thing transformers' renderer provides
TEMPLATES = {
    "trimmed blocks and special tokens": (
        "{{ bos_token }}{% for m in messages %}\n  {% if m.role == 'user' %}\nU: {{ m.content }}{{ eos_token }}\n"
        "  {% else %}\n{{ m.role[0] }}: {{ m.content }}\n  {% endif %}\n{% endfor %}\n"
        "{% if add_generation_prompt %}A:{% endif %}"
    ),
    "loop controls": "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% if m.role == 'system' %}"
    "{% continue %}{% endif %}[{{ m.content }}]{% endfor %}",
    "tojson without html escaping": "{{ messages | tojson }}|{{ messages[1] | tojson(indent=2, sort_keys=True) }}",
    "namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m.content | length %}"
    "{% endfor %}{{ ns.n }}",
    "dict": "{% set d = dict(a=1, b=2) %}{{ d | dictsort }}{{ dict.fromkeys(['x'], 0) }}",
    "generation tag": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}<{{ m.content }}>"
    "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}",
    "tools and documents are none": "{{ tools is none }} {{ documents is none }}",
    "strftime_now": "{{ strftime_now('%Y') | length }}",
}


@pytest.fixture(scope="module")
def special_tokens(real_hf_tokenizer) -> dict[str, str]:
    return dict(real_hf_tokenizer.special_tokens_map)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_renders_what_transformers_renders(real_hf_tokenizer, special_tokens, name, add_generation_prompt):
    source = TEMPLATES[name]
    ours = ChatTemplate(source, special_tokens).render(MESSAGES, add_generation_prompt)
    theirs = real_hf_tokenizer.apply_chat_template(
        MESSAGES, chat_template=source, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours == theirs


def test_special_tokens_are_variables(special_tokens):
    template = ChatTemplate("{{ bos_token }}|{{ eos_token }}|{{ pad_token }}", special_tokens)
    assert template.render([]) == "<|im_start|>|<|im_end|>|<|im_end|>"


def test_raise_exception_refuses_the_conversation():
    template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}", {})
    with pytest.raises(jinja2.TemplateError, match="user first"):
        template.render([{"role": "assistant", "content": "hi"}])


def test_a_namespace_attribute_with_a_leading_underscore_is_refused():
    with pytest.raises(jinja2.exceptions.SecurityError, match="_x"):
        ChatTemplate("{% set ns = namespace(_x=1) %}", {}).render([])


def test_the_sandbox_refuses_to_change_the_messages():
    template = ChatTemplate("{% set _ = messages.append({'role': 'user'}) %}{{ messages | length }}", {})
    with pytest.raises(jinja2.exceptions.SecurityError):
        template.render([{"role": "user", "content": "hi"}])


def test_keys_set_to_none_are_dropped():
    template = ChatTemplate("{{ messages[0] | tojson }}", {})
    assert template.render([{"role": "user", "content": "hi", "name": None}]) == '{"role": "user", "content": "hi"}'
