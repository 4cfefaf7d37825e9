"""When the model client hands a request to httpx because of a proxy (``replica.http_proxied``):
never when no proxy variable applies, always when httpx itself would use one."""

from __future__ import annotations

import httpx
import pytest

from replica import http1_client
from replica.http_proxied import _translated, proxy_applies

PROXY = "http://127.0.0.1:3128"

CASES = [
    # (environment, scheme, host, applies)
    ({}, "https", "api.openai.com", False),
    ({"https_proxy": PROXY}, "https", "api.openai.com", True),
    ({"https_proxy": PROXY}, "http", "api.openai.com", False),
    ({"http_proxy": PROXY}, "http", "10.0.0.5", True),
    ({"all_proxy": PROXY}, "https", "api.openai.com", True),
    ({"https_proxy": PROXY, "no_proxy": "*"}, "https", "api.openai.com", False),
    ({"https_proxy": PROXY, "no_proxy": "openai.com"}, "https", "api.openai.com", False),
    ({"https_proxy": PROXY, "no_proxy": "openai.com"}, "https", "openai.com", False),
    ({"https_proxy": PROXY, "no_proxy": "openai.com"}, "https", "notopenai.com", True),
    ({"https_proxy": PROXY, "no_proxy": ".openai.com"}, "https", "api.openai.com", False),
    ({"https_proxy": PROXY, "no_proxy": ".openai.com"}, "https", "openai.com", True),
    (
        {"https_proxy": PROXY, "no_proxy": "a.test, API.OpenAI.com "},
        "https",
        "api.openai.com",
        False,
    ),
    ({"http_proxy": PROXY, "no_proxy": "127.0.0.1"}, "http", "127.0.0.1", False),
    ({"http_proxy": PROXY, "no_proxy": "10.0.0.1"}, "http", "127.0.0.1", True),
    ({"http_proxy": PROXY, "no_proxy": "::1"}, "http", "::1", False),
    ({"http_proxy": PROXY, "no_proxy": "localhost"}, "http", "localhost", False),
    ({"http_proxy": PROXY, "no_proxy": "localhost"}, "http", "a.localhost", True),
    # Ranges, ports and URL patterns are httpx's to judge.
    ({"http_proxy": PROXY, "no_proxy": "127.0.0.0/8"}, "http", "127.0.0.1", True),
    ({"http_proxy": PROXY, "no_proxy": "example.com:8080"}, "http", "example.com", True),
]


@pytest.mark.parametrize(("environment", "scheme", "host", "applies"), CASES)
def test_proxy_applies(environment: dict[str, str], scheme: str, host: str, applies: bool) -> None:
    # As urllib.request.getproxies gives them: "https_proxy" is "https".
    proxies = {name.removesuffix("_proxy"): value for name, value in environment.items()}
    assert proxy_applies(scheme, host, proxies) is applies


@pytest.mark.parametrize(("environment", "scheme", "host", "applies"), CASES)
def test_a_request_sent_direct_is_one_httpx_would_send_direct(
    monkeypatch: pytest.MonkeyPatch,
    environment: dict[str, str],
    scheme: str,
    host: str,
    applies: bool,
) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert proxy_applies(scheme, host) is applies  # read from the environment
    netloc = f"[{host}]" if ":" in host else host
    client = httpx.Client()
    try:
        # httpx's own choice of transport for the URL (a private method: the only way to ask).
        direct = (
            client._transport_for_url(httpx.URL(f"{scheme}://{netloc}/v1")) is client._transport
        )
    finally:
        client.close()
    if not applies:
        assert direct


@pytest.mark.parametrize(
    ("theirs", "ours"),
    [
        (httpx.ConnectTimeout("x"), http1_client.ConnectTimeout),
        (httpx.PoolTimeout("x"), http1_client.ConnectTimeout),
        (httpx.WriteTimeout("x"), http1_client.WriteTimeout),
        (httpx.ReadTimeout("x"), http1_client.ReadTimeout),
        (httpx.ConnectError("x"), http1_client.ConnectError),
        (httpx.WriteError("x"), http1_client.WriteError),
        (httpx.ReadError("x"), http1_client.ReadError),
        (httpx.RemoteProtocolError("x"), http1_client.RemoteProtocolError),
        (httpx.DecodingError("x"), http1_client.HTTPError),
    ],
)
def test_an_httpx_error_becomes_the_lean_client_s_of_the_same_meaning(
    theirs: httpx.HTTPError, ours: type[Exception]
) -> None:
    translated = _translated(theirs)
    assert type(translated) is ours
    # The message names the class only: an httpx message may quote the request.
    assert str(translated) == f"through a proxy ({type(theirs).__name__})"
