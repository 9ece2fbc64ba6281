"""An unmodified OpenFeature flagd provider (Python, in-process resolver) behind crd-broker's
caller identity: it reads its own namespace's FeatureFlag, and is refused another namespace's.

Usage: flagd_tenancy_check.py allowed|refused

The provider is configured only by the environment the test sets (FLAGD_RESOLVER=in-process,
FLAGD_HOST, FLAGD_SYNC_PORT, FLAGD_SOURCE_SELECTOR): it sends no credentials, and the broker
knows it by the address it connects from. `allowed`: it becomes ready and evaluates the CR's
flags. `refused`: for the whole check it never evaluates a flag of the CR it may not read. The
last line printed is a JSON summary; any departure raises and the exit status is non-zero.
"""

import json
import logging
import os
import sys
import time

from openfeature import api
from openfeature.contrib.provider.flagd import FlagdProvider


class Refusals(logging.Handler):
    """Keeps what the provider logs about a PERMISSION_DENIED stream."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        message = record.getMessage()
        if "PERMISSION_DENIED" in message:
            self.messages.append(message)


def main():
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    refusals = Refusals()
    logging.getLogger().addHandler(refusals)
    mode = sys.argv[1]
    summary = {"mode": mode, "selector": os.environ["FLAGD_SOURCE_SELECTOR"]}
    if mode == "allowed":
        started = time.monotonic()
        api.set_provider_and_wait(FlagdProvider(), "tenant")
        summary["ready_seconds"] = round(time.monotonic() - started, 3)
        client = api.get_client("tenant")
        # The CR's default variant is "off": False, against a default of True.
        details = client.get_boolean_details("new-checkout", True)
        assert details.value is False and details.error_code is None, details
        summary["reason"] = str(details.reason)
    elif mode == "refused":
        try:
            api.set_provider(FlagdProvider(), "tenant")
        except Exception as error:  # a provider may report the refusal at once
            summary["set_provider_error"] = repr(error)
        client = api.get_client("tenant")
        seen = set()
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            details = client.get_boolean_details("new-checkout", True)
            assert details.value is True, f"read a flag it may not read: {details}"
            assert details.error_code is not None, details
            seen.add(str(details.error_code))
            time.sleep(0.05)
        summary["error_codes"] = sorted(seen)
        assert refusals.messages, "the provider saw no PERMISSION_DENIED"
        summary["refusal"] = refusals.messages[0]
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    api.shutdown()
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
