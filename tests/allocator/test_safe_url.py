"""``safe_url``: the one redaction of store URLs, used by the log's errors and the server's start-up line."""

from __future__ import annotations

import pytest

from nanoserve.allocator.log.errors import safe_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql+psycopg://app:s3cret@db.internal:5432/log", "postgresql+psycopg://app:***@db.internal:5432/log"),
        ("postgresql+psycopg://app@db.internal/log", "postgresql+psycopg://app@db.internal/log"),
        ("sqlite:////var/lib/nanoserve/log.db", "sqlite:////var/lib/nanoserve/log.db"),
        ("sqlite:///:memory:", "sqlite:///:memory:"),
    ],
)
def test_safe_url_hides_only_the_password(url: str, shown: str) -> None:
    assert safe_url(url) == shown


def test_safe_url_hides_the_password_of_a_url_sqlalchemy_cannot_parse() -> None:
    assert safe_url("not a scheme://app:p@ss@host/x") == "not a scheme://app:***@host/x"
    assert safe_url("no url at all") == "no url at all"


def test_server_start_line_uses_safe_url() -> None:
    from nanoserve.service.grpc.server import _shown_url

    assert _shown_url(None) is None
    assert _shown_url("postgresql://u:pw@h/d") == "postgresql://u:***@h/d"
