"""`/metrics` read by the official Python client's parsers: Prometheus text format 0.0.4 unless
the scraper's Accept asks for OpenMetrics, as Prometheus and the client libraries negotiate."""

import json
import urllib.request

from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families as text_families

# What Prometheus 2.x/3.x sends when scraping.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def scrape(gate, accept=None):
    headers = {"Accept": accept} if accept is not None else {}
    req = urllib.request.Request(gate + "/metrics", headers=headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.headers["Content-Type"], r.read().decode()


def some_traffic(gate):
    assert post(gate + "/v1/claim", {"namespace": "py", "key": "m1"}) == 200
    assert post(gate + "/v1/claim", {"namespace": "py", "key": "m1"}) == 200
    assert post(gate + "/v1/claim", {"namespace": "py"}) == 400


def check_families(families):
    by_name = {f.name: f for f in families}
    assert by_name["dedupgate_decisions"].type == "counter"
    assert by_name["dedupgate_errors"].type == "counter"
    assert by_name["dedupgate_records_swept"].type == "counter"
    assert by_name["dedupgate_request_duration_seconds"].type == "histogram"
    assert by_name["dedupgate_requests_in_flight"].type == "gauge"
    # A TYPE line that does not name its samples leaves them in an untyped family of their own.
    assert not [f.name for f in families if f.type in ("unknown", "untyped")]
    decisions = {(s.name, s.labels["namespace"], s.labels["outcome"]): s.value
                 for s in by_name["dedupgate_decisions"].samples}
    assert decisions[("dedupgate_decisions_total", "py", "new")] == 1
    assert decisions[("dedupgate_decisions_total", "py", "duplicate_in_progress")] == 1
    errors = {s.labels["code"]: s.value for s in by_name["dedupgate_errors"].samples
              if s.name == "dedupgate_errors_total"}
    assert errors["invalid_request"] == 1


def test_prometheus_text_format_by_default(gate):
    some_traffic(gate)
    for accept in (None, "*/*", "text/plain", "text/plain;version=0.0.4"):
        content_type, text = scrape(gate, accept)
        assert content_type == "text/plain; version=0.0.4; charset=utf-8", accept
        assert "# EOF" not in text
        check_families(list(text_families(text)))


def test_openmetrics_when_the_scraper_asks_for_it(gate):
    some_traffic(gate)
    for accept in (PROMETHEUS_ACCEPT, "application/openmetrics-text; version=1.0.0"):
        content_type, text = scrape(gate, accept)
        assert content_type == "application/openmetrics-text; version=1.0.0; charset=utf-8"
        assert text.endswith("# EOF\n")
        # The OpenMetrics parser is strict: it refuses text without `# EOF` or with 0.0.4's
        # counter TYPE lines.
        check_families(list(openmetrics_families(text)))
