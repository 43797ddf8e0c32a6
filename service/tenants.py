"""Tenants: who a caller is (tenant and role), and how a tenant's requests are kept apart.

A caller is an ``Identity``: a tenant name and a role, ``client`` or ``admin``.
The ``TenantTable`` maps bearer tokens, and the common names of verified
client certificates (mutual TLS, ``--tls-client-ca``), to identities; it is
read from the tokens file (``--auth-tokens-file``), one credential a line::

    # kind  credential       tenant   role
    token  s3cret-of-acme   acme     client
    token  ops-key-1        ops      admin
    cert   billing-worker   billing  client

Blank lines and ``#`` comments are skipped. A tenant name is 1..64 of
``A-Z a-z 0-9 . _ -``, so the ``/`` that scopes request ids cannot be forged
by a tenant's name. A token may appear once, a certificate name once.
``--auth-token T`` alone is the table ``{T: default/admin}``. A call that
carries a token is the token's identity; one without is its certificate's
(the subject's common name, as the TLS handshake verified it against
``--tls-client-ca``).

Invariant (isolation by construction, at the service boundary): a tenant's
request id ``x`` is the engine's request id ``"<tenant>/x"``, and its prefix
cache salt is ``"<tenant>/<cache_salt>"``. The engine, the journal (which thus
records the tenant) and recovery see ordinary ids; two tenants never meet in
the engine's registry nor in the prefix cache. ``ANONYMOUS`` (no auth
configured) has the empty name and scopes nothing: the server is then open,
as one tenant with admin rights.
"""

from __future__ import annotations

import enum
import hmac
import re
from dataclasses import dataclass
from pathlib import Path

TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
SCOPE_SEPARATOR = "/"
DEFAULT_TENANT = "default"  # the tenant of --auth-token


class Role(enum.Enum):
    CLIENT = "client"  # generation, tokenizer, model info, health
    ADMIN = "admin"  # also the operator surfaces: events, audit, pool status, cache resets, KV events


class TenantsFileError(ValueError):
    """The tokens file cannot be read or a line of it is malformed; the message names file and line."""


@dataclass(frozen=True)
class Identity:
    """A resolved caller. ``tenant == ""`` is the anonymous tenant of a server without auth."""

    tenant: str
    role: Role

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN

    @property
    def prefix(self) -> str:
        """What this tenant's engine ids and cache salts start with ("" for the anonymous tenant)."""
        return f"{self.tenant}{SCOPE_SEPARATOR}" if self.tenant else ""

    def engine_id(self, client_id: str) -> str:
        """The engine's request id of this tenant's ``client_id``."""
        return self.prefix + client_id

    def client_id(self, engine_id: str) -> str:
        """The inverse of ``engine_id``: the id this tenant knows."""
        assert engine_id.startswith(self.prefix), f"request {engine_id!r} is not tenant {self.tenant!r}'s"
        return engine_id[len(self.prefix) :]

    def cache_salt(self, cache_salt: str, shared: bool) -> str:
        """The prefix-cache salt of this tenant's request: scoped by tenant unless ``shared``.

        ``"tenant/"`` (no client salt) and ``"tenant/s"`` never equal another tenant's salts:
        the tenant name holds no ``/``. "" means no salt (the engine's None).
        """
        return cache_salt if shared else self.prefix + cache_salt


ANONYMOUS = Identity("", Role.ADMIN)


@dataclass(frozen=True)
class TenantTable:
    """Bearer token -> Identity, and client certificate common name -> Identity. Token lookup
    compares every token in constant time per token, so neither a token nor which one matched
    can be guessed from the timing byte by byte (a certificate name is no secret: the handshake
    proved the key)."""

    by_token: tuple[tuple[bytes, Identity], ...]
    by_cert: tuple[tuple[str, Identity], ...] = ()

    def lookup(self, token: bytes) -> Identity | None:
        found = None
        for known, identity in self.by_token:
            if hmac.compare_digest(known, token):
                found = identity
        return found

    def lookup_cert(self, common_name: str) -> Identity | None:
        """The identity of a verified client certificate whose subject CN is ``common_name``."""
        return dict(self.by_cert).get(common_name)

    @property
    def num_tokens(self) -> int:
        return len(self.by_token)

    @property
    def num_certs(self) -> int:
        return len(self.by_cert)

    @classmethod
    def single_token(cls, token: str) -> TenantTable:
        """``--auth-token``: one admin tenant, ``default``."""
        return cls(((token.encode(), Identity(DEFAULT_TENANT, Role.ADMIN)),))

    @classmethod
    def parse(cls, text: str, source: str = "<tokens>") -> TenantTable:
        """Parses the tokens file format (module docstring); TenantsFileError names ``source:line``."""
        tokens: list[tuple[bytes, Identity]] = []
        certs: list[tuple[str, Identity]] = []
        seen: set[tuple[str, str]] = set()
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            where = f"{source}:{number}"
            if len(fields) != 4 or fields[0] not in ("token", "cert"):
                raise TenantsFileError(
                    f"{where}: expected 'token TOKEN TENANT ROLE' or 'cert COMMON_NAME TENANT ROLE', "
                    f"got {len(fields)} field(s)"
                )
            kind, credential, tenant, role = fields
            if not TENANT_NAME.fullmatch(tenant):
                raise TenantsFileError(f"{where}: tenant must be 1..64 of A-Z a-z 0-9 . _ -, got {tenant!r}")
            if role not in {r.value for r in Role}:
                raise TenantsFileError(f"{where}: role must be 'client' or 'admin', got {role!r}")
            what = "token" if kind == "token" else "certificate name"
            if (kind, credential) in seen:
                raise TenantsFileError(f"{where}: this {what} is already given on an earlier line")
            seen.add((kind, credential))
            identity = Identity(tenant, Role(role))
            if kind == "token":
                tokens.append((credential.encode(), identity))
            else:
                certs.append((credential, identity))
        if not tokens and not certs:
            raise TenantsFileError(f"{source}: no tokens or certificates (an empty table would refuse every call)")
        return cls(tuple(tokens), tuple(certs))

    @classmethod
    def read(cls, path: str | Path) -> TenantTable:
        """Reads and parses the tokens file; TenantsFileError when it cannot be read or parsed."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TenantsFileError(f"{path}: cannot read the tokens file: {exc}") from None
        return cls.parse(text, str(path))


def scoped_id(caller: Identity, client_id: str) -> str:
    """The engine's request id of ``caller``'s ``client_id``; InvalidRequestError("request_id") when the
    scoped id would pass the engine's limit (the tenant's prefix counts against it)."""
    from nanoserve.engine.text.input_processor import MAX_REQUEST_ID_CHARS  # the engine imports torch: late

    limit = MAX_REQUEST_ID_CHARS - len(caller.prefix)
    if len(client_id) > limit:
        from nanoserve.engine.errors import InvalidRequestError

        raise InvalidRequestError(
            "request_id", f"at most {limit} characters for tenant {caller.tenant!r}, got {len(client_id)}"
        )
    return caller.engine_id(client_id)
