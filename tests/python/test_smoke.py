"""The gate answers a claim and its duplicate over plain HTTP from Python's standard library."""

import json
import urllib.request


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def test_first_claim_is_new_and_the_second_a_duplicate(gate):
    body = {"namespace": "py", "key": "evt_1"}
    assert post(gate + "/v1/claim", body)["outcome"] == "new"
    again = post(gate + "/v1/claim", body)
    assert again["outcome"] == "duplicate"
    assert again["record"]["state"] == "in_progress"
