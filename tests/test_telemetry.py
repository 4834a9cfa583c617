"""Layer 5 (operator/telemetry.py, operator/prometheus.py): the suspect GPU's DCGM telemetry on the incident.

The judgement is pure and tested on hand-made samples. The queries run against a real Prometheus
server (Debian's, unpacked by ``make tools`` into .venv/bin) scraping a stand-in dcgm-exporter that
this module serves: three nodes of 8 GPUs, series named and labelled as dcgm-exporter does
(``Hostname``, ``gpu``, ``UUID``); one GPU gets an XID 79 and two double-bit ECC errors while the
test runs. The operator then runs as a subprocess (tests/conftest.py ``make_world``) against the
same Prometheus, and against one that never answers: containment goes ahead, the incident says
"telemetry unavailable". SigV4: the signed request reaches a local server, whose received headers
are checked with botocore's own signer.
"""
from __future__ import annotations

import http.server
import inspect
import json
import pathlib
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
import uuid
from typing import Any

import pytest
from conftest import condition, make_alarm, new_instance

from sdcguard.contract import names, text
from sdcguard_operator import prometheus, telemetry
from sdcguard_operator.settings import Settings

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMETHEUS = shutil.which("prometheus") or str(ROOT / ".venv" / "bin" / "prometheus")
HOST = "127.0.0.1"


# --- the judgement, pure --------------------------------------------------------------------------

def test_an_sdc_relevant_xid_corroborates_another_is_only_noted() -> None:
    judged = telemetry.judge_series("DCGM_FI_DEV_XID_ERRORS", [0, 0, 79, 79], gpu="3")
    assert judged.corroborates and judged.finding == "XID 79" and "fallen off the bus" in judged.seen
    other = telemetry.judge_series("DCGM_FI_DEV_XID_ERRORS", [0, 43, 43])
    assert not other.corroborates and other.noted and other.finding == "XID 43"
    assert telemetry.judge_series("DCGM_FI_DEV_XID_ERRORS", [0, 0]).seen == "no XID"


def test_counters_count_their_increase_across_a_reset() -> None:
    assert telemetry.increase([0, 1, 3, 0, 2]) == 5  # 0->1->3, reset, 0->2
    dbe = telemetry.judge_series("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", [4, 4, 6])
    assert dbe.corroborates and dbe.finding == "DBE +2"
    # errors from before the window: not in it
    assert not telemetry.judge_series("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", [4, 4, 4]).corroborates
    sbe = telemetry.judge_series("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", [0, 3])
    assert sbe.noted and not sbe.corroborates and sbe.finding == "SBE +3"
    nvlink = telemetry.judge_series("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", [10, 12])
    assert nvlink.corroborates and nvlink.finding == "NVLink replay +2"
    assert telemetry.judge_series("DCGM_FI_DEV_THERMAL_VIOLATION", [0, 2_500_000]).finding == "thermal violation 2.5 s"


def test_flags_bits_and_temperature() -> None:
    assert telemetry.judge_series("DCGM_FI_DEV_ROW_REMAP_FAILURE", [0, 1]).corroborates
    assert not telemetry.judge_series("DCGM_FI_DEV_ROW_REMAP_FAILURE", [0, 0]).corroborates
    clocks = telemetry.judge_series("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", [0x1, 0x41])
    assert clocks.noted and not clocks.corroborates and clocks.finding == "HW thermal slowdown"
    assert not telemetry.judge_series("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", [0x4]).noted  # a policy reason
    assert telemetry.judge_series("DCGM_FI_DEV_GPU_TEMP", [60, 91]).finding == "91 °C"
    assert not telemetry.judge_series("DCGM_FI_DEV_GPU_TEMP", [60, 70]).noted


def _series(metric: str, gpu: int, values: list[float], with_uuid: bool = True) -> dict[str, Any]:
    labels = {"__name__": metric, "gpu": str(gpu), "Hostname": "n1"}
    if with_uuid:
        labels["UUID"] = f"GPU-{gpu}"
    return {"metric": labels, "values": [[i, str(v)] for i, v in enumerate(values)]}


def test_the_suspect_gpu_is_picked_by_uuid_else_by_index_else_every_gpu_is_judged() -> None:
    matrix = [_series("DCGM_FI_DEV_XID_ERRORS", g, [0, 79] if g == 3 else [0, 0]) for g in range(8)]
    assert telemetry.judge_target(telemetry.Target("n1", 0, "GPU-3"), matrix)["findings"] == ["XID 79"]  # UUID wins
    assert telemetry.judge_target(telemetry.Target("n1", 5, "GPU-5"), matrix)["verdict"] == text.TELEMETRY_CLEAN
    # The UUID is on the series but matches none: that GPU has no data (never another GPU's).
    assert telemetry.judge_target(telemetry.Target("n1", 3, "GPU-x"), matrix)["verdict"] == text.TELEMETRY_NO_DATA
    no_uuids = [_series("DCGM_FI_DEV_XID_ERRORS", g, [0, 79] if g == 3 else [0, 0], with_uuid=False) for g in range(8)]
    assert telemetry.judge_target(telemetry.Target("n1", 3, "GPU-3"), no_uuids)["findings"] == ["XID 79"]
    every = telemetry.judge_target(telemetry.Target("n1"), matrix)
    assert every["findings"] == ["XID 79 (GPU 3)"] and every["clean"] == 7 and len(every["series"]) == 1


def test_the_summary_says_clean_clears_nothing_and_names_what_corroborates() -> None:
    quiet = [_series("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", 1, [0, 0])]
    clean = telemetry.summarize([telemetry.judge_target(telemetry.Target("n1", 1, "GPU-1"), quiet)], ["Hostname"])
    assert clean["verdict"] == text.TELEMETRY_CLEAN and "never clears" in clean["message"]
    bad = telemetry.summarize([telemetry.judge_target(telemetry.Target("n1", 1, "GPU-1"),
                                                      [_series("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", 1, [0, 2])]),
                               telemetry.judge_target(telemetry.Target("n2"), [])], ["Hostname"])
    assert bad["verdict"] == text.TELEMETRY_CORROBORATES and bad["findings"] == ["DBE +2 on n1"]
    assert "No DCGM series for n2" in bad["message"]
    assert telemetry.summarize([telemetry.judge_target(telemetry.Target("n2"), [])], ["Hostname"])["verdict"] \
        == text.TELEMETRY_NO_DATA


def test_the_line_kubectl_shows() -> None:
    assert text.telemetry_line(None) == "-"
    assert text.telemetry_line({"verdict": "Corroborates", "findings": ["XID 79", "DBE +2"], "final": True}) \
        == "corroborates (XID 79, DBE +2)"
    assert text.telemetry_line({"verdict": "Clean", "noted": ["SBE +3"], "final": False}) \
        == "clean (noted: SBE +3) so far"
    assert text.telemetry_line({"verdict": "Unavailable", "reason": "timed out"}) == "unavailable (timed out)"
    assert text.telemetry_line({"verdict": "NoData", "final": True}) == "no DCGM data"


def test_targets_window_and_the_query() -> None:
    record = make_alarm("ns", "llm", suspects=[(1, "p1", "n1"), (2, "p2", "n1"), (3, "p3", "n2")])
    record["suspects"][0]["gpu"] = {"index": 1, "uuid": "GPU-8b2c0e6f-1c1e-4d7a-9c55-0123456789ab"}
    record["suspects"][1]["gpu"] = {"index": 2, "uuid": None}
    spec = {"alarm": record, "suspects": []}
    assert telemetry.targets(spec) == [telemetry.Target("n1", 1, "GPU-8b2c0e6f-1c1e-4d7a-9c55-0123456789ab"),
                                       telemetry.Target("n1", 2, None),
                                       telemetry.Target("n2")]
    settings = Settings(telemetry_lookback_seconds=600, telemetry_margin_seconds=60)
    span = telemetry.window(spec, settings)
    at = telemetry.rfc3339_seconds(record["time"])
    assert (span.start, span.end) == (at - 600, at + 60) and "no step time" in span.basis  # an older library's record
    timed = dict(record, step=40, suspect_window={"first_step": 31, "last_step": 40}, step_seconds=2.5)
    span = telemetry.window({"alarm": timed}, settings)
    assert (span.start, span.end) == (at - 10 * 2.5 - 60, at + 60) and "first step (31)" in span.basis
    query = telemetry.selector('we"ird', ["Hostname", "node"])
    assert query.count(" or ") == 1 and 'Hostname="we\\"ird"' in query and "DCGM_FI_DEV_(XID_ERRORS|" in query
    assert telemetry.step_seconds(0, 3720) == 7 and telemetry.step_seconds(0, 30) == 1


def test_due_only_after_containment_acted_and_until_final() -> None:
    spec = {"suspects": [{"rank": 1, "node": "n1"}]}
    assert not telemetry.due(spec, {"phase": "Containing"})
    assert telemetry.due(spec, {"phase": "Containing", "nodes": {"n1": {"cordoned": True}}})
    assert telemetry.due(spec, {"phase": "Containing", "conditions": [{"type": "StormGuard", "status": "True"}]})
    assert telemetry.due(spec, {"phase": "AwaitingApproval"})
    assert not telemetry.due(spec, {"phase": "AwaitingApproval", "telemetry": {"final": True}})
    assert not telemetry.due({"suspects": []}, {"phase": "Contained"})
    assert not telemetry.due(spec, {"conditions": [{"type": "Verified", "status": "False"}]})


def test_settings() -> None:
    settings = Settings.from_env({"SDCGUARD_PROMETHEUS_URL":
                                  "https://aps-workspaces.us-west-2.amazonaws.com/workspaces/ws-1",
                                  "SDCGUARD_PROMETHEUS_TOKEN": "s3cret", "SDCGUARD_TELEMETRY_NODE_LABELS": "Hostname"})
    assert settings.telemetry_node_labels == ("Hostname",) and settings.prometheus_sigv4 == "auto"
    assert "s3cret" not in repr(settings)  # the operator logs its settings
    for bad in ({"SDCGUARD_PROMETHEUS_URL": "prometheus:9090"}, {"SDCGUARD_PROMETHEUS_SIGV4": "maybe"},
                {"SDCGUARD_TELEMETRY_ATTEMPTS": "0"}, {"SDCGUARD_TELEMETRY_NODE_LABELS": 'Hostname="x"'}):
        with pytest.raises(ValueError, match="SDCGUARD_"):
            Settings.from_env(bad)


def test_sigv4_region() -> None:
    amp = "https://aps-workspaces.eu-west-1.amazonaws.com/workspaces/ws-1"
    assert prometheus.sigv4_region(amp, "auto", None) == "eu-west-1"
    assert prometheus.sigv4_region(amp, "false", None) is None
    assert prometheus.sigv4_region("http://prometheus:9090", "auto", "us-east-1") is None
    assert prometheus.sigv4_region("https://vpce-1.example", "true", "us-east-1") == "us-east-1"
    with pytest.raises(prometheus.Unavailable, match="region"):
        prometheus.sigv4_region("https://vpce-1.example", "true", None)


def test_the_lookup_is_a_timer_of_its_own_only_with_a_prometheus() -> None:
    """Registered beside containment (never inside it), polling at SDCGUARD_POLL_SECONDS, filtered by :func:`due`."""
    import kopf

    from sdcguard_operator import main

    def timers(settings: Settings) -> dict[str, Any]:
        registry = kopf.OperatorRegistry()
        main.register(registry, settings, webhooks_too=False)
        return {h.id: h for h in registry._spawning.get_all_handlers()}

    with_prometheus = timers(Settings(poll_seconds=7.0, prometheus_url="http://prometheus:9090"))
    assert with_prometheus["incident_telemetry"].interval == 7.0
    assert with_prometheus["incident_telemetry"].when is telemetry.due
    # async: while it waits on Prometheus (in telemetry.pool()) it holds no thread of kopf's executor
    assert inspect.iscoroutinefunction(with_prometheus["incident_telemetry"].fn)
    assert "incident_telemetry" not in timers(Settings(poll_seconds=7.0))


# --- SigV4 and bearer tokens, checked where the request lands ------------------------------------

class _Capture(http.server.BaseHTTPRequestHandler):
    seen: list[tuple[str, dict[str, str]]] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).seen.append((self.path, dict(self.headers.items())))
        body = b'{"status":"success","data":{"resultType":"matrix","result":[]}}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def capture():
    _Capture.seen = []
    server = http.server.ThreadingHTTPServer((HOST, 0), _Capture)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://{HOST}:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_workspace_query_is_signed_with_sigv4_for_aps(capture: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "session-token")
    settings = Settings(prometheus_url=f"{capture}/workspaces/ws-1/", prometheus_sigv4="true", region="us-west-2",
                        prometheus_token="never-sent")
    prometheus.Client.from_settings(settings).query_range('up{job="a b"}', 100, 200, 15)
    [(path, headers)] = _Capture.seen
    assert path.startswith("/workspaces/ws-1/api/v1/query_range?")
    assert urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)["query"] == ['up{job="a b"}']
    auth = headers["Authorization"]
    assert auth.startswith("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/") and "/us-west-2/aps/aws4_request" in auth
    assert headers["X-Amz-Security-Token"] == "session-token" and "Bearer" not in auth
    # The signature, recomputed by botocore from what the server received, agrees.
    received = AWSRequest(method="GET", url=capture + path, headers={"X-Amz-Date": headers["X-Amz-Date"],
                                                                      "X-Amz-Security-Token": "session-token"})
    signer = SigV4Auth(Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "session-token"),
                       "aps", "us-west-2")
    received.context["timestamp"] = headers["X-Amz-Date"]
    expected = signer.signature(signer.string_to_sign(received, signer.canonical_request(received)), received)
    assert auth.endswith(f"Signature={expected}")
    wrong = SigV4Auth(Credentials("AKIDEXAMPLE", "another-secret", "session-token"), "aps", "us-west-2")
    assert not auth.endswith(wrong.signature(wrong.string_to_sign(received, wrong.canonical_request(received)),
                                             received))


def test_another_prometheus_gets_the_bearer_token_and_no_signature(capture: str) -> None:
    client = prometheus.Client.from_settings(Settings(prometheus_url=capture, prometheus_token="t0ken"))
    client.query_range("up", 1, 2, 1)
    [(_, headers)] = _Capture.seen
    assert headers["Authorization"] == "Bearer t0ken" and "X-Amz-Date" not in headers


def test_a_redirect_is_not_followed_with_the_credentials(capture: str) -> None:
    """A signed or bearer request is never replayed to another host: a 3xx is a failed attempt."""
    moved = Scripted(lambda node, out: out.write(f"HTTP/1.0 302 Found\r\nLocation: {capture}/api/v1/query_range"
                                                 "\r\nContent-Length: 0\r\n\r\n".encode()))
    try:
        with pytest.raises(prometheus.Unavailable, match="HTTP 302"):
            prometheus.Client.from_settings(Settings(prometheus_url=moved.url, prometheus_token="t0ken")) \
                .query_range("up", 1, 2, 1)
        assert _Capture.seen == [] and len(moved.nodes) == 1
    finally:
        moved.close()


# --- Prometheus down or slow ------------------------------------------------------------------------

@pytest.fixture
def black_hole():
    """A port that accepts connections and never answers (a hung Prometheus)."""
    with socket.socket() as listener:
        listener.bind((HOST, 0))
        listener.listen(16)
        yield f"http://{HOST}:{listener.getsockname()[1]}"


def test_prometheus_slow_or_down_is_unavailable_within_the_timeout(black_hole: str) -> None:
    started = time.monotonic()
    with pytest.raises(prometheus.Unavailable, match=r"no answer from http://127.0.0.1:\d+ within 1 s"):
        prometheus.Client(url=black_hole, timeout=1).query_range("up", 1, 2, 1)
    assert time.monotonic() - started < 3
    with socket.socket() as s:
        s.bind((HOST, 0))
        closed = s.getsockname()[1]
    with pytest.raises(prometheus.Unavailable, match="cannot reach"):
        prometheus.Client(url=f"http://{HOST}:{closed}", timeout=1).query_range("up", 1, 2, 1)


class Scripted:
    """A local HTTP server that answers every GET with ``answer(node, wfile)`` — raw bytes, status
    line and all, so it can misbehave as no real Prometheus does on purpose — after ``delay``
    seconds. It records the node each query names (``Hostname="..."``) and the most requests it
    held at once."""

    def __init__(self, answer: Any, delay: float = 0.0) -> None:
        self.answer, self.delay = answer, delay
        self.nodes: list[str] = []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()
        scripted = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query).get("query", [""])[0]
                found = re.search(r'Hostname="([^"]*)"', query)
                with scripted.lock:
                    scripted.nodes.append(found.group(1) if found else "")
                    scripted.in_flight += 1
                    scripted.most_in_flight = max(scripted.most_in_flight, scripted.in_flight)
                try:
                    time.sleep(scripted.delay)
                    scripted.answer(found.group(1) if found else "", self.wfile)
                except OSError:
                    pass  # the client gave up
                finally:
                    with scripted.lock:
                        scripted.in_flight -= 1

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((HOST, 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://{HOST}:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _http(body: bytes | str, status: str = "200 OK") -> bytes:
    body = body.encode() if isinstance(body, str) else body
    return (f"HTTP/1.0 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() \
        + body


def _matrix(*series: Any) -> bytes:
    return _http(json.dumps({"status": "success", "data": {"resultType": "matrix", "result": list(series)}}))


def _xid_series(value: Any) -> dict[str, Any]:
    return {"metric": {"__name__": "DCGM_FI_DEV_XID_ERRORS", "gpu": "1", "Hostname": "n1"},
            "values": [[1, "0"], [2, value]]}


@pytest.mark.parametrize("answer, reason", [
    (_matrix(_xid_series("abc")), "unreadable series for n1 from http://127.0.0.1:"),  # float("abc")
    (_matrix(_xid_series("+Inf")), "unreadable series for n1"),  # int(inf): OverflowError
    (_matrix(_xid_series(["1"])), "unreadable series for n1"),
    (_matrix("a string"), "a series that is not {metric, values"),
    (_matrix({"metric": {}, "values": [[1]]}), "a series that is not {metric, values"),
    (_http('{"status": "success", "data": [1]}'), "unexpected answer: resultType 'list'"),
    (_http('{"status": "success", "data": {"resultType": "vector", "result": []}}'), "resultType 'vector'"),
    (_http("[" * 100_000), "did not answer JSON"),  # json's RecursionError
    (_http(b"\xff\xfe"), "did not answer JSON"),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\n{\"status\"", "did not answer JSON"),  # cut short
    (b"SSH-2.0-OpenSSH_9.2\r\n", "bad HTTP answer from http://127.0.0.1:"),  # not HTTP at all
])
def test_an_answer_it_cannot_read_is_unavailable_never_another_error(answer: bytes, reason: str) -> None:
    """An odd answer is a failed attempt (counted, then "unavailable"), never an exception kopf would retry forever."""
    server = Scripted(lambda node, out: out.write(answer))
    try:
        record = make_alarm("ns", "llm", suspects=[(1, "p1", "n1")])
        record["suspects"][0]["gpu"] = {"index": 1, "uuid": None}
        settings = Settings(prometheus_url=server.url, telemetry_timeout_seconds=5)
        with pytest.raises(prometheus.Unavailable) as raised:
            telemetry.lookup({"alarm": record}, settings, prometheus.Client.from_settings(settings), time.time())
        assert reason in raised.value.reason
    finally:
        server.close()


def test_a_lookup_ends_by_its_deadline_and_a_trickling_answer_by_its_timeout() -> None:
    # Each answer takes 0.6 s: within the 1 s request timeout, but four nodes cannot fit a 1.5 s lookup.
    slow = Scripted(lambda node, out: out.write(_matrix()), delay=0.6)
    try:
        record = make_alarm("ns", "llm", suspects=[(r, f"p{r}", f"n{r}") for r in range(1, 5)])
        settings = Settings(prometheus_url=slow.url, telemetry_timeout_seconds=1)
        client = prometheus.Client.from_settings(settings)
        started = time.monotonic()
        with pytest.raises(prometheus.Unavailable, match="within|time limit"):
            telemetry.lookup({"alarm": record}, settings, client, time.time(), deadline=started + 1.5)
        assert time.monotonic() - started < 2.3 and slow.nodes == ["n1", "n2", "n3"]
        assert telemetry.deadline_seconds(settings) == telemetry.DEADLINE_REQUESTS * 1
    finally:
        slow.close()

    def trickle(node: str, out: Any) -> None:  # headers at once, then a byte of JSON whitespace every 0.2 s
        out.write(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n")
        for _ in range(50):
            out.write(b" ")
            out.flush()
            time.sleep(0.2)
    dripping = Scripted(trickle)
    try:
        started = time.monotonic()
        with pytest.raises(prometheus.Unavailable, match="took longer than 1 s"):
            prometheus.Client(url=dripping.url, timeout=1).query_range("up", 1, 2, 1)
        assert time.monotonic() - started < 2.5  # every socket read was quick: only the whole is too slow
    finally:
        dripping.close()


def test_at_most_max_targets_are_looked_up_one_query_per_node() -> None:
    server = Scripted(lambda node, out: out.write(_matrix()))
    try:
        suspects = [(r, f"p{r}", f"n{r}") for r in range(1, telemetry.MAX_TARGETS + 3)]
        record = make_alarm("ns", "llm", suspects=[(0, "p0", "n1"), *suspects])  # two GPUs on n1
        record["suspects"][0]["gpu"], record["suspects"][1]["gpu"] = {"index": 0}, {"index": 1}
        settings = Settings(prometheus_url=server.url, telemetry_margin_seconds=0)
        result = telemetry.lookup({"alarm": record}, settings, prometheus.Client.from_settings(settings), time.time())
        assert len(result["targets"]) == telemetry.MAX_TARGETS
        assert server.nodes == [f"n{r}" for r in range(1, telemetry.MAX_TARGETS)]  # n1 asked once for both GPUs
        assert "3 more suspects not looked up (at most 8 per incident)" in result["message"]
    finally:
        server.close()


# --- a real Prometheus over a stand-in dcgm-exporter -------------------------------------------------

class Exporter:
    """dcgm-exporter's /metrics for a set of nodes × 8 GPUs; ``fault(node, gpu)`` gives that GPU an
    XID 79 and two double-bit ECC errors from then on."""

    def __init__(self) -> None:
        self.nodes: list[str] = []
        self.faults: set[tuple[str, int]] = set()
        self.lock = threading.Lock()
        exporter = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                body = exporter.exposition().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((HOST, 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.address = f"{HOST}:{self.server.server_address[1]}"

    @staticmethod
    def uuid(node: str, gpu: int) -> str:
        return f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}/{gpu}')}"

    def add(self, *nodes: str) -> None:
        with self.lock:
            self.nodes.extend(nodes)

    def fault(self, node: str, gpu: int) -> None:
        with self.lock:
            self.faults.add((node, gpu))

    def exposition(self) -> str:
        fields = {"DCGM_FI_DEV_XID_ERRORS": "gauge", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "counter",
                  "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "counter", "DCGM_FI_DEV_ROW_REMAP_FAILURE": "gauge",
                  "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": "counter", "DCGM_FI_DEV_GPU_TEMP": "gauge",
                  "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": "gauge", "DCGM_FI_DEV_POWER_USAGE": "gauge"}
        lines = []
        with self.lock:
            for metric, kind in fields.items():
                lines.append(f"# TYPE {metric} {kind}")
                for node in self.nodes:
                    for gpu in range(8):
                        bad = (node, gpu) in self.faults
                        value = {"DCGM_FI_DEV_XID_ERRORS": 79 if bad else 0,
                                 "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 2 if bad else 0,
                                 "DCGM_FI_DEV_GPU_TEMP": 40 + gpu, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": 1,
                                 "DCGM_FI_DEV_POWER_USAGE": 300.5}.get(metric, 0)
                        labels = (f'gpu="{gpu}",UUID="{self.uuid(node, gpu)}",pci_bus_id="00000000:{gpu:02X}:00.0",'
                                  f'device="nvidia{gpu}",modelName="NVIDIA H100 80GB HBM3",Hostname="{node}",'
                                  'DCGM_FI_DRIVER_VERSION="550.127.05"')
                        lines.append(f"{metric}{{{labels}}} {value}")
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class PrometheusServer:
    """The real ``prometheus`` binary on 127.0.0.1, scraping ``target`` every second."""

    def __init__(self, workdir: pathlib.Path, target: str) -> None:
        if not pathlib.Path(PROMETHEUS).exists():
            pytest.fail(f"{PROMETHEUS} is missing: `make tools` unpacks it from Debian's prometheus package")
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        config = workdir / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
                          f"scrape_configs:\n  - job_name: dcgm-exporter\n    static_configs:\n"
                          f"      - targets: ['{target}']\n")
        self.url = f"http://{HOST}:{port}"
        self.log = open(workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                                      f"--web.listen-address={HOST}:{port}", "--storage.tsdb.retention.time=1h"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.wait(lambda: self.get("/-/ready"), "ready")

    def get(self, path: str) -> bytes | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.proc.returncode}")
        try:
            with urllib.request.urlopen(self.url + path, timeout=2) as answer:
                return answer.read()
        except OSError:
            return None

    def count(self, promql: str) -> int:
        data = prometheus.Client(url=self.url, timeout=5).get("api/v1/query", {"query": f"count({promql})"})
        return int(float(data["result"][0]["value"][1])) if data.get("result") else 0

    @staticmethod
    def wait(predicate: Any, what: str, timeout: float = 60) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = predicate()
            if found:
                return found
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for Prometheus: {what}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def dcgm(tmp_path_factory: pytest.TempPathFactory):
    exporter = Exporter()
    server = PrometheusServer(tmp_path_factory.mktemp("prometheus"), exporter.address)
    yield exporter, server
    server.close()
    exporter.close()


def _scraped(server: PrometheusServer, node: str, samples: int) -> None:
    """Wait until Prometheus holds ``samples`` scrapes of the node's 8 GPUs (the window's clean start)."""
    query = f'count_over_time(DCGM_FI_DEV_GPU_TEMP{{Hostname="{node}"}}[1m]) >= {samples}'
    server.wait(lambda: server.count(query) == 8,
                f"{samples} scrapes of {node}")


def test_real_promql_over_a_stand_in_exporter_finds_the_faulty_gpu(dcgm: tuple[Exporter, PrometheusServer]) -> None:
    exporter, server = dcgm
    nodes = [f"hyperpod-i-{new_instance()[2:]}" for _ in range(3)]
    exporter.add(*nodes)
    for node in nodes:
        _scraped(server, node, 3)
    exporter.fault(nodes[0], 3)
    server.wait(lambda: server.count(f'DCGM_FI_DEV_XID_ERRORS{{Hostname="{nodes[0]}"}} == 79') == 1, "the XID scraped")
    record = make_alarm("ns", "llm", suspects=[(3, "p3", nodes[0]), (5, "p5", nodes[1])])
    record["suspects"][0]["gpu"] = {"index": 3, "uuid": exporter.uuid(nodes[0], 3)}
    record["suspects"][1]["gpu"] = {"index": 5, "uuid": exporter.uuid(nodes[1], 5)}
    settings = Settings(prometheus_url=server.url, telemetry_lookback_seconds=120, telemetry_margin_seconds=0,
                        telemetry_node_labels=("Hostname", "node"))
    client = prometheus.Client.from_settings(settings)
    now = time.time()
    result = telemetry.lookup({"alarm": record}, settings, client, now)
    assert result["verdict"] == text.TELEMETRY_CORROBORATES and result["final"] is True
    assert result["findings"] == [f"DBE +2 on {nodes[0]}", f"XID 79 on {nodes[0]}"]
    faulty, clean = result["targets"]
    assert (faulty["verdict"], clean["verdict"]) == (text.TELEMETRY_CORROBORATES, text.TELEMETRY_CLEAN)
    assert faulty["matched"] == f"UUID {exporter.uuid(nodes[0], 3)}"
    assert {s["metric"] for s in faulty["series"]} == {
        "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"}  # what this exporter serves of FIELDS (not POWER_USAGE)
    assert all(s["uuid"] == exporter.uuid(nodes[0], 3) for s in faulty["series"])
    assert next(s for s in clean["series"] if s["metric"] == "DCGM_FI_DEV_GPU_TEMP")["seen"] == "max 45 °C"

    # The GPU the alarm names alone: a clean neighbour on the faulty node stays clean; no GPU named:
    # every GPU of the node is judged, and the finding says which one.
    neighbour = dict(record, suspects=[dict(record["suspects"][0],
                                            gpu={"index": 4, "uuid": exporter.uuid(nodes[0], 4)})])
    assert telemetry.lookup({"alarm": neighbour}, settings, client, now)["verdict"] == text.TELEMETRY_CLEAN
    anywhere = dict(record, suspects=[{k: v for k, v in record["suspects"][0].items() if k != "gpu"}])
    assert telemetry.lookup({"alarm": anywhere}, settings, client, now)["findings"] \
        == ["DBE +2 (GPU 3)", "XID 79 (GPU 3)"]
    unknown = dict(record, suspects=[dict(record["suspects"][0], node="hyperpod-i-0000000000000000f")])
    assert telemetry.lookup({"alarm": unknown}, settings, client, now)["verdict"] == text.TELEMETRY_NO_DATA
    # Before the window closes the lookup is not final (the timer asks again after it).
    early = Settings(prometheus_url=server.url, telemetry_lookback_seconds=120, telemetry_margin_seconds=600)
    assert telemetry.lookup({"alarm": record}, early, client, now)["final"] is False


# --- the operator: the incident gets its telemetry, and containment never waits for it ----------------

def _telemetry(world: Any, ns: str, name: str) -> dict[str, Any]:
    return (world.incident(ns, name).get("status") or {}).get("telemetry") or {}


def _final(world: Any, ns: str, name: str) -> dict[str, Any] | None:
    found = _telemetry(world, ns, name)
    return found if found.get("final") else None


@pytest.mark.emulator
@pytest.mark.operator
def test_the_operator_records_corroborating_telemetry_on_the_incident(make_world, dcgm) -> None:
    exporter, server = dcgm
    world = make_world(SDCGUARD_PROMETHEUS_URL=server.url, SDCGUARD_TELEMETRY_LOOKBACK_SECONDS="120",
                       SDCGUARD_TELEMETRY_MARGIN_SECONDS="2", SDCGUARD_TELEMETRY_NODE_LABELS="Hostname,node")
    ns = "telemetry"
    nodes = [world.node(new_instance()) for _ in range(2)]
    exporter.add(*nodes)
    pods = world.training(ns, "llm", nodes)
    for node in nodes:
        _scraped(server, node, 3)
    exporter.fault(nodes[1], 6)
    dbe = f'DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{Hostname="{nodes[1]}"}} == 2'
    server.wait(lambda: server.count(dbe) == 1, "DBE scraped")
    record = make_alarm(ns, "llm", step=40, suspects=[(1, pods[1], nodes[1])], reporter=(0, pods[0], nodes[0]))
    record["suspects"][0]["gpu"] = {"index": 6, "uuid": exporter.uuid(nodes[1], 6)}  # as the library names it on CUDA
    world.alarm_event(ns, record)
    found = world.wait(lambda: _final(world, ns, "llm-replay-40"), what="final telemetry")
    assert found["verdict"] == "Corroborates" and found["findings"] == ["DBE +2", "XID 79"]
    assert found["summary"] == "corroborates (DBE +2, XID 79)" and found["source"] == server.url
    [target] = found["targets"]
    assert target["matched"] == f"UUID {exporter.uuid(nodes[1], 6)}" and target["gpu"] == 6
    incident = world.incident(ns, "llm-replay-40")
    events = [e["event"] for e in incident["status"]["timeline"]]
    assert events.index("NodeCordoned") < events.index("Telemetry")
    assert world.node_state(nodes[1]) == (True, "true")
    assert 'sdcguard_incident_telemetry_corroborated{incident="telemetry/llm-replay-40"} 1.0' in world.metrics()
    assert 'sdcguard_incident_telemetry_total{verdict="Corroborates"} 1.0' in world.metrics()
    listing = world.kubectl("sdcguard", "incidents")
    assert listing.returncode == 0 and "corroborates (DBE +2, XID 79)" in listing.stdout, listing


@pytest.mark.emulator
@pytest.mark.operator
@pytest.mark.slow  # its own operator world: make test-slow (the real-PromQL test stays in make test)
def test_a_hung_prometheus_never_delays_containment(make_world, black_hole: str) -> None:
    world = make_world(SDCGUARD_PROMETHEUS_URL=black_hole, SDCGUARD_TELEMETRY_TIMEOUT_SECONDS="3",
                       SDCGUARD_TELEMETRY_ATTEMPTS="2")
    ns = "telemetry-down"
    nodes = [world.node(new_instance()) for _ in range(2)]
    pods = world.training(ns, "llm", nodes)
    world.alarm_event(ns, make_alarm(ns, "llm", step=7, suspects=[(1, pods[1], nodes[1])],
                                     reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: world.node_state(nodes[1]) == (True, "true"), what="cordoned")
    # Cordoned while the lookup (2 attempts of 3 s at least) has not finished.
    assert not _telemetry(world, ns, "llm-replay-7").get("final")
    contained = world.wait(lambda: condition(world.incident(ns, "llm-replay-7"), "Contained"), what="contained")
    assert contained["status"] == "True"
    found = world.wait(lambda: _final(world, ns, "llm-replay-7"), what="telemetry given up")
    assert found["verdict"] == "Unavailable" and found["failures"] == 2
    assert "within 3 s" in found["reason"] and found["summary"].startswith("unavailable (no answer from")
    assert "nothing is cleared" in found["message"]
    events = [e["event"] for e in world.incident(ns, "llm-replay-7")["status"]["timeline"]]
    assert events.index("NodeCordoned") < events.index("Contained") < events.index("Telemetry")


@pytest.mark.emulator
@pytest.mark.operator
@pytest.mark.slow
def test_lookups_keep_to_their_threads_and_never_look_at_an_unsealed_incident(make_world) -> None:
    """Several incidents due at once, each lookup held 3 s by a slow Prometheus: at most
    telemetry.THREADS requests are ever in flight, a new alarm is still contained at once, an
    unreadable answer is a counted failure, and an incident the operator did not create (status
    forged to look contained) is never looked up."""
    from sdcguard_operator import incident as incident_module

    forged_node = f"hyperpod-i-{new_instance()[2:]}"
    garbled: list[str] = []  # the node whose every answer carries a value that is not a number

    def answer(node: str, out: Any) -> None:
        series = [] if node not in garbled else [{"metric": {"__name__": "DCGM_FI_DEV_GPU_TEMP", "gpu": "0",
                                                             "Hostname": node}, "values": [[1, "hot"]]}]
        out.write(_matrix(*series))
    slow = Scripted(answer, delay=3.0)
    try:
        world = make_world(SDCGUARD_PROMETHEUS_URL=slow.url, SDCGUARD_TELEMETRY_TIMEOUT_SECONDS="5",
                           SDCGUARD_TELEMETRY_ATTEMPTS="100", SDCGUARD_TELEMETRY_MARGIN_SECONDS="900",
                           SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES="20", SDCGUARD_SUSPEND_JOBS="false")
        ns, due_at_once = "telemetry-busy", 6
        nodes = [world.node(new_instance()) for _ in range(due_at_once + 2)]
        pods = world.training(ns, "llm", nodes)
        garbled.append(nodes[1])

        # An SDCIncident anyone with create rights can write: the alarm's shape, no operator seal.
        forged = incident_module.manifest(make_alarm(ns, "llm", step=999, suspects=[(1, pods[1], forged_node)],
                                                     reporter=(0, pods[0], nodes[0])), "forged")
        world.custom.create_namespaced_custom_object(names.GROUP, names.VERSION, ns, names.INCIDENTS, forged)
        name = forged["metadata"]["name"]
        world.wait(lambda: (condition(world.incident(ns, name), "Verified") or {}).get("status") == "False",
                   what="the forged incident refused")
        world.custom.patch_namespaced_custom_object_status(names.GROUP, names.VERSION, ns, names.INCIDENTS, name, {
            "status": {"phase": "Contained", "conditions": [], "repeatOffenders": [],
                       "nodes": {forged_node: {"cordoned": True}}}})

        for i in range(1, due_at_once + 1):
            world.alarm_event(ns, make_alarm(ns, "llm", step=i, suspects=[(i, pods[i], nodes[i])],
                                             reporter=(0, pods[0], nodes[0])))
        world.wait(lambda: {nodes[i] for i in range(1, due_at_once + 1)} <= set(slow.nodes), timeout=90,
                   what="every incident's lookup under way")

        # Every lookup thread is busy: a new alarm is still taken in and its node cordoned at once.
        started = time.monotonic()
        new = due_at_once + 1
        world.alarm_event(ns, make_alarm(ns, "llm", step=new, suspects=[(new, pods[new], nodes[new])],
                                         reporter=(0, pods[0], nodes[0])))
        world.wait(lambda: world.node_state(nodes[new]) == (True, "true"), timeout=20, what="the new node cordoned")
        contained_in = time.monotonic() - started
        assert contained_in < 3.0 * 2, contained_in  # less than two held lookups, on a busy 2-core machine

        assert slow.most_in_flight <= telemetry.THREADS, slow.most_in_flight
        unreadable = world.wait(lambda: _telemetry(world, ns, "llm-replay-1").get("failures"), timeout=30,
                                what="the unreadable answer counted")
        found = _telemetry(world, ns, "llm-replay-1")
        assert unreadable >= 1 and found["verdict"] == "Unavailable" and "unreadable series" in found["reason"]
        assert not found["final"]  # 100 attempts allowed
        assert _telemetry(world, ns, "llm-replay-2").get("verdict") == "NoData"
        assert forged_node not in slow.nodes and "telemetry" not in (world.incident(ns, name).get("status") or {})
    finally:
        slow.close()
