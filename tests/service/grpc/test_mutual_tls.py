"""Mutual TLS (issue 31): ``--tls-client-ca`` makes the handshake require a client certificate
signed by that CA, and a ``cert COMMON_NAME TENANT ROLE`` line of the tokens file makes the
certificate's subject name a tenant, scoped and refused exactly as a bearer token's tenant is.

A second gRPC server with TLS, a client CA and a tokens file sits in front of the tiny model's
engine. The certificates are made here with the ``openssl`` command (elliptic-curve keys, one day).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from nanoserve.service.config import ServerConfig
from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import allocation_pb2_grpc, generation_pb2_grpc
from nanoserve.v1 import generation_pb2 as pb

from ..conftest import Served

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKENS = """\
cert billing-worker billing client
cert ops-console    ops     admin
token beta-key      beta    client
"""


@dataclass(frozen=True)
class Pki:
    """A CA, the server's certificate (127.0.0.1) and client certificates by common name."""

    folder: Path

    def pem(self, name: str) -> bytes:
        return (self.folder / f"{name}.pem").read_bytes()

    def key(self, name: str) -> bytes:
        return (self.folder / f"{name}.key").read_bytes()

    def client(self, name: str, ca: str = "ca") -> grpc.ChannelCredentials:
        """Channel credentials trusting the server's CA and presenting client certificate ``name``."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.pem("ca"), private_key=self.key(name), certificate_chain=self.pem(name)
        )


def _openssl(folder: Path, *args: str) -> None:
    openssl = shutil.which("openssl")
    assert openssl is not None
    subprocess.run([openssl, *args], check=True, capture_output=True, cwd=folder)


def _make_ca(folder: Path, name: str) -> None:
    _openssl(
        folder,
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        "-days",
        "1",
        "-subj",
        f"/CN={name}",
    )


def _make_cert(folder: Path, name: str, ca: str, extensions: str) -> None:
    (folder / f"{name}.ext").write_text(extensions)
    _openssl(
        folder,
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        f"/CN={name}",
    )
    _openssl(
        folder,
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.pem",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-out",
        f"{name}.pem",
        "-days",
        "1",
        "-extfile",
        f"{name}.ext",
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make certificates")
    folder = tmp_path_factory.mktemp("pki")
    _make_ca(folder, "ca")
    _make_ca(folder, "other-ca")
    _make_cert(folder, "server", "ca", "subjectAltName=IP:127.0.0.1\n")
    for name in ("billing-worker", "ops-console", "stranger"):
        _make_cert(folder, name, "ca", "extendedKeyUsage=clientAuth\n")
    _make_cert(folder, "forged", "other-ca", "extendedKeyUsage=clientAuth\n")
    # "forged" claims a known name, signed by a CA the server does not trust
    _make_cert(folder, "billing-worker-forged", "other-ca", "extendedKeyUsage=clientAuth\n")
    return Pki(folder)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mtls(tiny_served: Served, pki: Pki) -> AsyncIterator[Any]:
    from nanoserve.service.grpc.server import NanoServer

    tokens = pki.folder / "tokens"
    tokens.write_text(TOKENS)
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        metrics_port=None,
        tls_cert=str(pki.folder / "server.pem"),
        tls_key=str(pki.folder / "server.key"),
        tls_client_ca=str(pki.folder / "ca.pem"),
        auth_tokens_file=str(tokens),
    )
    server = NanoServer(tiny_served.engine, config, owns_engine=False)
    await server.start()
    yield server
    await server.stop(0)


def _channel(server: Any, credentials: grpc.ChannelCredentials) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(f"127.0.0.1:{server.port}", credentials)


def _request(request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt="a certified hello",
        sampling=pb.SamplingParameters(max_tokens=3, temperature=0.0, ignore_eos=True),
    )


async def _error(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if hasattr(call, "__aiter__"):
            [r async for r in call]
        else:
            await call
    return info.value.code(), info.value.details() or ""


async def test_a_certificate_named_in_the_tokens_file_is_its_tenant_with_its_role(mtls: Any, pki: Pki) -> None:
    async with _channel(mtls, pki.client("billing-worker")) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        responses = [r async for r in stub.Generate(_request("invoice-1"))]
        assert responses[0].request_id == "invoice-1"  # the tenant's own id, not billing/invoice-1
        assert sum(len(r.token_ids) for r in responses) == 3
        code, details = await _error(
            allocation_pb2_grpc.AllocationServiceStub(channel).GetPoolStatus(apb.GetPoolStatusRequest())
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert details.endswith("/GetPoolStatus needs role 'admin'; tenant 'billing' has role 'client'")
        resumed = [r async for r in stub.Resume(pb.ResumeRequest(request_id="invoice-1"))]
        assert [t for r in resumed for t in r.token_ids] == [t for r in responses for t in r.token_ids]
    async with _channel(mtls, pki.client("ops-console")) as channel:
        status = await allocation_pb2_grpc.AllocationServiceStub(channel).GetPoolStatus(apb.GetPoolStatusRequest())
        assert status.num_blocks == 512
        # another tenant's request id is not the ops tenant's either: ids are scoped per tenant
        code, _ = await _error(
            generation_pb2_grpc.GenerationServiceStub(channel).Resume(pb.ResumeRequest(request_id="invoice-1"))
        )
        assert code == grpc.StatusCode.NOT_FOUND


async def test_a_token_names_the_caller_over_any_certificate(mtls: Any, pki: Pki) -> None:
    async with _channel(mtls, pki.client("billing-worker")) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        beta = (("authorization", "Bearer beta-key"),)
        [r async for r in stub.Generate(_request("beta-1"), metadata=beta)]
        code, _ = await _error(stub.Resume(pb.ResumeRequest(request_id="beta-1")))  # billing does not see it
        assert code == grpc.StatusCode.NOT_FOUND
        resumed = [r async for r in stub.Resume(pb.ResumeRequest(request_id="beta-1"), metadata=beta)]
        assert sum(len(r.token_ids) for r in resumed) == 3
        code, _ = await _error(
            stub.Resume(pb.ResumeRequest(request_id="x"), metadata=(("authorization", "Bearer nope"),))
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED  # a wrong token is not passed over for the certificate


async def test_a_signed_certificate_the_tokens_file_does_not_name_is_unauthenticated(mtls: Any, pki: Pki) -> None:
    async with _channel(mtls, pki.client("stranger")) as channel:
        code, details = await _error(generation_pb2_grpc.GenerationServiceStub(channel).Generate(_request("s-1")))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert details == (
        "missing or wrong 'authorization: Bearer <token>' metadata, and no client certificate named in the tokens file"
    )


@pytest.mark.parametrize("client", ["none", "forged", "billing-worker-forged"])
async def test_no_certificate_or_one_from_another_ca_fails_the_handshake(mtls: Any, pki: Pki, client: str) -> None:
    if client == "none":
        credentials = grpc.ssl_channel_credentials(root_certificates=pki.pem("ca"))
    else:
        credentials = pki.client(client)
    async with _channel(mtls, credentials) as channel:
        code, _ = await _error(
            generation_pb2_grpc.GenerationServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        )
    assert code == grpc.StatusCode.UNAVAILABLE


async def test_a_client_ca_without_a_server_certificate_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="tls_client_ca needs tls_cert and tls_key"):
        ServerConfig(tls_client_ca="/etc/ca.pem")
