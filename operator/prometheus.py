"""A small Prometheus HTTP API client: ``/api/v1/query_range``, plain, bearer-token or SigV4-signed.

Amazon Managed Prometheus (the HyperPod observability add-on's store) takes only requests signed
with AWS Signature Version 4 for the service ``aps``: the operator signs with its own credentials
(IRSA / EKS Pod Identity, botocore's default chain) when the URL is a workspace's
(``aps-workspaces.<region>.amazonaws.com``), or when told to (``SDCGUARD_PROMETHEUS_SIGV4=true``:
a VPC endpoint or proxy under another name). Any other server gets the request as it is, with
``Authorization: Bearer <token>`` when a token is set.

Every failure is one exception, :class:`Unavailable`, whose ``reason`` is short enough to show on
an incident — an answer that is not the matrix asked for too; nothing here retries (the caller
bounds attempts) and every request has a time limit: each socket operation, and reading the answer
as a whole (a server that trickles bytes is cut off).
"""
from __future__ import annotations

import dataclasses
import http.client
import json
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from .settings import Settings

SIGV4_SERVICE = "aps"
AMP_HOST = re.compile(r"^aps-workspaces(?:-fips)?\.([a-z0-9-]+)\.amazonaws\.com$")
MAX_ANSWER_BYTES = 64 * 1024 * 1024
"""A query_range answer larger than this is refused (a node's DCGM series over an hour are < 1 MiB)."""


class Unavailable(Exception):
    """Prometheus could not be asked or did not answer usefully; ``reason`` says why, in a line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def sigv4_region(url: str, mode: str, region: str | None) -> str | None:
    """The region to sign for, or None for an unsigned request. ``mode``: ``auto`` (sign an Amazon
    Managed Prometheus workspace URL, in the region its host names), ``true`` (always, in the URL's
    region if it names one, else ``region``), ``false`` (never)."""
    if mode == "false":
        return None
    found = AMP_HOST.match(urllib.parse.urlsplit(url).hostname or "")
    if found:
        return found.group(1)
    if mode == "true":
        if not region:
            raise Unavailable("SigV4 signing needs a region (SDCGUARD_REGION or AWS_REGION)")
        return region
    return None


def query_string(params: dict[str, str]) -> str:
    """``params`` percent-encoded as SigV4's canonical query string wants (RFC 3986, ``%20`` for a
    space): botocore signs the query exactly as it is sent."""
    return urllib.parse.urlencode(params, quote_via=urllib.parse.quote)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Client:
    url: str
    """The API root: ``http://prometheus:9090`` or ``https://aps-workspaces.<region>.amazonaws.com/workspaces/<id>``."""
    timeout: float
    """Seconds for one request: connecting and reading the answer."""
    token: str | None = dataclasses.field(default=None, repr=False)
    region: str | None = None
    """Sign with SigV4 for this region (None: no signature)."""

    @classmethod
    def from_settings(cls, settings: Settings) -> "Client":
        if not settings.prometheus_url:
            raise Unavailable("SDCGUARD_PROMETHEUS_URL is not set")
        return cls(url=settings.prometheus_url, timeout=settings.telemetry_timeout_seconds,
                   token=settings.prometheus_token,
                   region=sigv4_region(settings.prometheus_url, settings.prometheus_sigv4, settings.region))

    def until(self, deadline: float | None) -> "Client":
        """This client, its timeout cut to what is left until ``deadline`` (``time.monotonic()``;
        None: no cut); Unavailable once it has passed."""
        if deadline is None:
            return self
        left = deadline - time.monotonic()
        if left <= 0:
            raise Unavailable("the lookup ran past its time limit (Prometheus answers too slowly)")
        return dataclasses.replace(self, timeout=min(self.timeout, left))

    def query_range(self, query: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """The matrix ``query`` gives over [start, end] (Unix seconds) at ``step`` seconds:
        ``[{"metric": {label: value}, "values": [[t, "v"], ...]}]`` (that shape checked; the
        values are the caller's to read)."""
        data = self.get("api/v1/query_range", {"query": query, "start": _number(start), "end": _number(end),
                                               "step": _number(step)})
        if not isinstance(data, dict) or data.get("resultType") != "matrix" or not isinstance(data.get("result"), list):
            kind = data.get("resultType") if isinstance(data, dict) else type(data).__name__
            raise Unavailable(f"unexpected answer: resultType {kind!r}")
        for series in data["result"]:
            if not (isinstance(series, dict) and isinstance(series.get("metric"), dict)
                    and isinstance(series.get("values"), list)
                    and all(isinstance(p, list) and len(p) == 2 for p in series["values"])):
                raise Unavailable("unexpected answer: a series that is not {metric, values: [[t, v], ...]}")
        return data["result"]

    def get(self, path: str, params: dict[str, str]) -> dict[str, Any]:
        """GET ``<url>/<path>?<params>``; the ``data`` of a ``status: success`` answer."""
        url = f"{self.url.rstrip('/')}/{path}?{query_string(params)}"
        headers = {"Accept": "application/json"}
        if self.region:
            headers.update(sign(url, self.region))
        elif self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(url, headers=headers, method="GET")
        deadline = time.monotonic() + self.timeout
        try:
            with _opener().open(request, timeout=self.timeout) as answer:
                body = _read(answer, deadline)
        except urllib.error.HTTPError as exc:
            raise Unavailable(f"HTTP {exc.code} from {where(self.url)}: {_error_text(exc)}") from None
        except urllib.error.URLError as exc:
            raise Unavailable(f"cannot reach {where(self.url)}: {_reason(exc.reason)}") from None
        except (TimeoutError, socket.timeout):
            raise Unavailable(f"no answer from {where(self.url)} within {self.timeout:g} s") from None
        except OSError as exc:
            raise Unavailable(f"cannot reach {where(self.url)}: {_reason(exc)}") from None
        except http.client.HTTPException as exc:  # not HTTP, or cut short
            raise Unavailable(f"bad HTTP answer from {where(self.url)}: {type(exc).__name__}") from None
        if body is None:
            raise Unavailable(f"the answer from {where(self.url)} took longer than {self.timeout:g} s")
        if len(body) > MAX_ANSWER_BYTES:
            raise Unavailable(f"answer larger than {MAX_ANSWER_BYTES} bytes")
        try:
            answer_json = json.loads(body)
        except (ValueError, RecursionError):
            raise Unavailable(f"{where(self.url)} did not answer JSON (is it the Prometheus API root?)") from None
        if not isinstance(answer_json, dict) or answer_json.get("status") != "success":
            error = answer_json.get("error") if isinstance(answer_json, dict) else None
            raise Unavailable(f"query failed: {str(error or answer_json)[:200]}")
        return answer_json.get("data") or {}


def sign(url: str, region: str) -> dict[str, str]:
    """SigV4 headers (``Authorization``, ``X-Amz-Date``, the session token if any) for a GET of
    ``url``, with the operator's AWS credentials (botocore's default chain)."""
    import botocore.session
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest

    from botocore.exceptions import BotoCoreError

    try:
        credentials = botocore.session.get_session().get_credentials()
        if credentials is None:
            raise Unavailable("no AWS credentials to sign the query with (IRSA / Pod Identity / AWS_* variables)")
        request = AWSRequest(method="GET", url=url)
        SigV4Auth(credentials.get_frozen_credentials(), SIGV4_SERVICE, region).add_auth(request)
    except BotoCoreError as exc:  # e.g. the web identity token could not be exchanged
        raise Unavailable(f"cannot sign the query: {str(exc)[:200]}") from None
    return {k: v for k, v in request.headers.items() if k.lower() != "host"}


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """No redirect is followed: a signed or bearer request is never replayed to another host (a 3xx
    is an HTTPError, and so "unavailable")."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def _read(answer: Any, deadline: float) -> bytes | None:
    """The answer's body, at most MAX_ANSWER_BYTES + 1 bytes; None past ``deadline``."""
    chunks, size = [], 0
    while size <= MAX_ANSWER_BYTES:
        if time.monotonic() > deadline:
            return None
        chunk = answer.read1(min(1 << 20, MAX_ANSWER_BYTES + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _opener() -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(_NoRedirect)


def _number(value: float) -> str:
    return f"{value:.3f}".rstrip("0").rstrip(".")


def where(url: str) -> str:
    """The server, for messages: scheme, host, port and path (never a query or credentials)."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "") + parts.path.rstrip("/")


def _reason(reason: Any) -> str:
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return "timed out"
    return str(getattr(reason, "strerror", None) or reason)[:200]


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        body = exc.read(4096)
        return str(json.loads(body).get("error") or exc.reason)[:200]
    except Exception:  # noqa: BLE001 - an error page that is not Prometheus JSON
        return str(exc.reason)[:200]
