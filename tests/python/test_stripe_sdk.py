"""Stripe's Python SDK through `dedupgate proxy` with Stripe's error format (`errors = "stripe"`).

The upstream is a small Stripe-shaped API written here (POST /v1/customers answers a customer
object and counts executions); the SDK talks to the proxy in front of it. With problem JSON, a
key reused with another payload made the SDK raise "Invalid response object from API"; with
Stripe's format it raises the SDK's own IdempotencyError, InvalidRequestError and APIError.
"""

import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import stripe

# Stripe's format on Stripe's paths, where the key is required; problem JSON elsewhere.
CONFIG = """
[[route]]
methods = ["POST"]
path = "/v1/**"
key = "required"
errors = "stripe"
"""


class StripeShaped:
    """A Stripe-shaped upstream on a free port: POST /v1/customers creates a customer (after
    `delay` seconds when the email starts with "slow"), counting executions."""

    def __init__(self):
        self.executions = 0
        self.lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                form = urllib.parse.parse_qs(self.rfile.read(length).decode())
                email = form.get("email", [""])[0]
                if self.path != "/v1/customers":
                    self._send(404, {"error": {"type": "invalid_request_error",
                                               "message": f"Unrecognized request URL (POST: {self.path})"}})
                    return
                if email.startswith("slow"):
                    time.sleep(1.5)
                with api.lock:
                    api.executions += 1
                    n = api.executions
                self._send(200, {"id": f"cus_{n}", "object": "customer", "email": email,
                                 "livemode": False})

            def _send(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Request-Id", f"req_{self.server.server_port}")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def upstream():
    api = StripeShaped()
    yield api
    api.close()


@pytest.fixture
def proxy(start, upstream, tmp_path):
    """The proxy in front of the upstream, Stripe's format on /v1 from the config file."""
    config = tmp_path / "proxy.toml"
    config.write_text(CONFIG)
    return start("proxy", "--upstream", upstream.url, "--store", "memory:", "--config", config)


def client(url, retries=0):
    return stripe.StripeClient("sk_test_dedupgate", base_addresses={"api": url},
                               max_network_retries=retries)


def test_a_repeat_replays_the_first_response(proxy, upstream):
    c = client(proxy.url)
    first = c.v1.customers.create({"email": "a@example.com"}, {"idempotency_key": "cus-a"})
    again = c.v1.customers.create({"email": "a@example.com"}, {"idempotency_key": "cus-a"})
    assert first.id == again.id == "cus_1"
    assert again.last_response.headers["Idempotent-Replayed"] == "true"
    assert upstream.executions == 1


def test_a_key_reused_with_another_payload_raises_idempotency_error(proxy, upstream):
    c = client(proxy.url)
    c.v1.customers.create({"email": "b@example.com"}, {"idempotency_key": "cus-b"})
    with pytest.raises(stripe.IdempotencyError) as e:
        c.v1.customers.create({"email": "other@example.com"}, {"idempotency_key": "cus-b"})
    assert e.value.http_status == 400
    assert e.value.json_body["error"]["type"] == "idempotency_error"
    assert upstream.executions == 1


def test_a_key_in_flight_is_retried_by_the_sdk_then_replayed(proxy, upstream):
    results = {}

    def first():
        results["first"] = client(proxy.url).v1.customers.create(
            {"email": "slow@example.com"}, {"idempotency_key": "cus-slow"})

    t = threading.Thread(target=first)
    t.start()
    time.sleep(0.4)
    # Without retries the SDK shows the 409 (Stripe's idempotency_key_in_use)...
    with pytest.raises(stripe.APIError) as e:
        client(proxy.url).v1.customers.create({"email": "slow@example.com"},
                                              {"idempotency_key": "cus-slow"})
    assert e.value.http_status == 409
    assert e.value.json_body["error"] == {
        "type": "idempotency_error", "code": "idempotency_key_in_use",
        "message": e.value.json_body["error"]["message"]}
    # ...with them it retries the 409 until the first request's response is stored.
    second = client(proxy.url, retries=5).v1.customers.create(
        {"email": "slow@example.com"}, {"idempotency_key": "cus-slow"})
    t.join()
    assert second.id == results["first"].id
    assert upstream.executions == 1


def test_an_overlong_or_missing_key_is_an_invalid_request_error(proxy, upstream):
    with pytest.raises(stripe.InvalidRequestError) as e:
        client(proxy.url).v1.customers.create({"email": "c@example.com"},
                                              {"idempotency_key": "k" * 256})
    assert e.value.http_status == 400
    # The SDK puts a key on every POST; a client that sends none gets Stripe's shape too.
    req = urllib.request.Request(proxy.url + "/v1/customers", data=b"email=c%40example.com",
                                 method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400
    assert json.load(e.value)["error"]["type"] == "invalid_request_error"
    assert upstream.executions == 0


def test_an_unavailable_store_raises_api_error(start, upstream):
    # --errors stripe on the command line; nothing listens on port 1, so the store never opens
    # and gated requests get 503.
    p = start("proxy", "--upstream", upstream.url, "--store", "redis://127.0.0.1:1",
              "--errors", "stripe")
    with pytest.raises(stripe.APIError) as e:
        client(p.url).v1.customers.create({"email": "d@example.com"},
                                          {"idempotency_key": "cus-d"})
    assert e.value.http_status == 503
    assert e.value.json_body["error"]["type"] == "api_error"
    assert upstream.executions == 0


def test_problem_json_stays_the_default(start, upstream):
    # What the SDK made of problem JSON: no IdempotencyError, an unparsable response.
    p = start("proxy", "--upstream", upstream.url, "--store", "memory:")
    c = client(p.url)
    c.v1.customers.create({"email": "e@example.com"}, {"idempotency_key": "cus-e"})
    with pytest.raises(stripe.APIError) as e:
        c.v1.customers.create({"email": "f@example.com"}, {"idempotency_key": "cus-e"})
    assert not isinstance(e.value, stripe.IdempotencyError)
    assert "Invalid response object from API" in str(e.value)
    assert e.value.http_status == 422
