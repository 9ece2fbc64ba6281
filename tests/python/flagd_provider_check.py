"""Drives real OpenFeature flagd providers (Python, in-process resolver) against crd-broker.

Usage: flagd_provider_check.py FAKE_API_SERVER_URL

The providers are configured only by the environment the test sets: FLAGD_RESOLVER=in-process,
FLAGD_HOST, FLAGD_SYNC_PORT, FLAGD_SOURCE_SELECTOR. The FeatureFlag `default/demo`
(examples/manifests/demo.yaml) exists when this starts; this script changes it through the fake
API server. It asks its parent (the Rust test) to check the API server's watches and to restart
the broker by printing `CHECK WATCHES <n>` or `RESTART` and waiting for `OK` on stdin. The last
line it prints is a JSON summary of what it measured. Any departure raises, and it exits non-zero.
"""

import json
import logging
import os
import sys
import time
import urllib.request

from openfeature import api
from openfeature.contrib.provider.flagd import FlagdProvider
from openfeature.evaluation_context import EvaluationContext
from openfeature.exception import ErrorCode

FAKE = sys.argv[1]
COLLECTION = f"{FAKE}/apis/core.openfeature.dev/v1beta1/namespaces/default/featureflags"
VIP = EvaluationContext(attributes={"email": "someone@example.com"})
OTHER = EvaluationContext(attributes={"email": "someone@elsewhere.org"})


def http(method, url, body=None, content_type="application/json"):
    data = None if body is None else json.dumps(body).encode()
    headers = {} if data is None else {"Content-Type": content_type}
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    with urllib.request.urlopen(request) as response:
        return json.loads(response.read() or b"null")


def patch(body):
    http("PATCH", f"{COLLECTION}/demo", body, "application/merge-patch+json")


def ask(line):
    print(line, flush=True)
    reply = sys.stdin.readline().strip()
    if reply != "OK":
        raise AssertionError(f"{line}: the test answered {reply!r}")


def eventually(what, probe, want, timeout):
    """Polls `probe` until it returns `want`; the seconds it took."""
    start = time.monotonic()
    while True:
        got = probe()
        if got == want:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: wanted {want!r} within {timeout}s, still {got!r}")
        time.sleep(0.005)


def evaluations(client):
    return (
        client.get_boolean_value("new-checkout", True),
        client.get_string_value("banner-color", "fallback", VIP),
        client.get_string_value("banner-color", "fallback", OTHER),
    )


def main():
    # The providers' own logs go to stderr, which the test shows when the check fails.
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    summary = {"env": {k: v for k, v in os.environ.items() if k.startswith("FLAGD_")}}
    original = http("GET", f"{COLLECTION}/demo")

    # READY within the provider's own 500 ms deadline, on a resource nobody watched yet.
    started = time.monotonic()
    api.set_provider_and_wait(FlagdProvider(), "first")
    summary["ready_seconds"] = round(time.monotonic() - started, 3)
    client = api.get_client("first")

    # A boolean flag and a string flag with targeting.
    assert evaluations(client) == (False, "#0a0", "#c00"), evaluations(client)
    details = client.get_string_details("banner-color", "fallback", VIP)
    assert details.reason == "TARGETING_MATCH", details

    # A PATCH of the CR reaches the provider within 1 s.
    patch({"spec": {"flagSpec": {"flags": {"new-checkout": {"defaultVariant": "on"}}}}})
    latency = eventually("patched flag", lambda: client.get_boolean_value("new-checkout", False), True, 1.0)
    summary["patch_to_evaluation_seconds"] = round(latency, 3)

    # Deleting the CR: evaluations fall back to the defaults. Re-creating restores them.
    http("DELETE", f"{COLLECTION}/demo")
    eventually("deleted flags", lambda: evaluations(client), (True, "fallback", "fallback"), 5.0)
    missing = client.get_boolean_details("new-checkout", True)
    assert missing.error_code == ErrorCode.FLAG_NOT_FOUND, missing
    recreate = {k: v for k, v in original.items() if k in ("apiVersion", "kind", "spec")}
    recreate["metadata"] = {"name": "demo", "namespace": "default"}
    http("POST", COLLECTION, recreate)
    eventually("re-created flags", lambda: evaluations(client), (False, "#0a0", "#c00"), 5.0)

    # Ten providers on the same CR: one watch on the API server.
    for i in range(9):
        api.set_provider_and_wait(FlagdProvider(), f"more-{i}")
        assert evaluations(api.get_client(f"more-{i}")) == (False, "#0a0", "#c00")
    ask("CHECK WATCHES 10")

    # The broker restarts; the providers recover by themselves and pick up a change made after.
    ask("RESTART")
    patch({"spec": {"flagSpec": {"flags": {"new-checkout": {"defaultVariant": "on"}}}}})
    recovered = eventually("after the restart", lambda: evaluations(client), (True, "#0a0", "#c00"), 30.0)
    summary["restart_recovery_seconds"] = round(recovered, 3)
    for i in range(9):
        more = api.get_client(f"more-{i}")
        eventually(f"provider {i} after the restart", lambda: evaluations(more), (True, "#0a0", "#c00"), 30.0)
    ask("CHECK WATCHES 10")

    api.shutdown()
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
