"""A scripted HTTP/1.1 server on 127.0.0.1, for the model client's odd cases: the tests write
the answer's bytes themselves (a broken stream, a slow head, chunked or Content-Length, a
server that closes kept-alive connections), and see what the client sent and did (its
requests, its connections, when it closed them)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import json
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True, slots=True)
class RawRequest:
    method: str
    target: str
    headers: dict[str, str]  # names lower-cased; the last value of a repeated name
    body: bytes
    connection: int  # 0 for the first connection the server accepted
    index: int  # 0 for the first request on its connection


Handler = Callable[[RawRequest, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]
"""Answers one request by writing to the connection; returns whether to read another request
on it (False: the server closes it). The reader is for a handler that waits for the client to
close (``client_gone``)."""


@dataclass
class RawServer:
    scheme: str = "http"
    port: int = 0
    requests: list[RawRequest] = field(default_factory=list)
    connections: int = 0
    # Set when the client closed its end of connection i (the server read EOF or a reset).
    client_closed: dict[int, asyncio.Event] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/v1"

    def closed(self, connection: int) -> asyncio.Event:
        return self.client_closed.setdefault(connection, asyncio.Event())


@contextlib.asynccontextmanager
async def raw_server(
    handler: Handler, tls: ssl.SSLContext | None = None
) -> AsyncIterator[RawServer]:
    state = RawServer("https" if tls else "http")
    tasks: set[asyncio.Task[None]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = state.connections
        state.connections += 1
        closed = state.closed(number)
        index = 0
        try:
            while True:
                request = await _read_request(reader, number, index)
                if request is None:
                    closed.set()
                    return
                state.requests.append(request)
                index += 1
                if not await handler(request, reader, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            closed.set()
        finally:
            writer.close()

    def start(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(serve(reader, writer))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    server = await asyncio.start_server(start, "127.0.0.1", 0, ssl=tls)
    state.port = server.sockets[0].getsockname()[1]
    try:
        yield state
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


async def _read_request(
    reader: asyncio.StreamReader, connection: int, index: int
) -> RawRequest | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return RawRequest(method, target, headers, body, connection, index)


async def client_gone(reader: asyncio.StreamReader) -> None:
    """Return once the client has closed the connection (EOF or a reset)."""
    with contextlib.suppress(ConnectionError):
        while await reader.read(65536):
            pass


def answer(
    status: int,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    *,
    chunked: bool = False,
    reason: str = "X",
) -> bytes:
    """A whole response: ``body`` framed by Content-Length, or as one chunk and the last."""
    lines = [f"HTTP/1.1 {status} {reason}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if chunked:
        lines.append("transfer-encoding: chunked")
        framed = (chunk(body) if body else b"") + b"0\r\n\r\n"
    else:
        lines.append(f"content-length: {len(body)}")
        framed = body
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + framed


def stream_head(content_type: str = "text/event-stream") -> bytes:
    """The head of a chunked answer whose chunks the test writes itself."""
    return (
        f"HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\n\r\n"
    ).encode()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"


def sse(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


def text_chunk(text: str, finish: str | None = None) -> bytes:
    """An SSE event holding one chat-completion chunk with ``text`` (and a finish reason)."""
    payload = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    return sse(json.dumps(payload))


@dataclass(frozen=True, slots=True)
class Certificates:
    ca: Path  # the authority's certificate (PEM), for a client's trust store
    server: ssl.SSLContext  # a server context with a certificate the authority signed


def certificates(directory: Path, names: tuple[str, ...] = ("127.0.0.1",)) -> Certificates:
    """A throwaway certificate authority and a server certificate it signed for ``names``
    (addresses or DNS names), written under ``directory``."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fleet test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for name in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt.append(x509.DNSName(name))
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_path = directory / "ca.pem"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    chain = directory / "server.pem"
    chain.write_bytes(
        leaf.public_bytes(serialization.Encoding.PEM)
        + key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(chain)
    return Certificates(ca_path, server)
