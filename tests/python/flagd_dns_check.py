"""The OpenFeature flagd provider (Python, in-process resolver) on a `dns://` host, through the
broker's maximum connection age and the loss of a replica: it keeps evaluating, and sees a
change made after both.

Usage: flagd_dns_check.py SECONDS

Configured by the environment the test sets (FLAGD_RESOLVER=in-process, FLAGD_HOST=dns://…,
FLAGD_SYNC_PORT, FLAGD_SOURCE_SELECTOR). Prints READY once the provider is, then evaluates
`new-checkout` (default variant "off", so `False`) every 50 ms for SECONDS, counting
evaluations that did not come from the flag configuration, and when (seconds after READY) it
first saw `True`. The last line is a JSON summary.
"""

import json
import sys
import time

from openfeature import api
from openfeature.contrib.provider.flagd import FlagdProvider
from openfeature.flag_evaluation import Reason


def main():
    seconds = float(sys.argv[1])
    api.set_provider(FlagdProvider())
    client = api.get_client()
    start = time.monotonic()
    while True:
        details = client.get_boolean_details("new-checkout", True)
        if details.value is False and details.reason != Reason.ERROR:
            break
        if time.monotonic() - start > 30:
            raise AssertionError(f"the provider did not become ready: {details}")
        time.sleep(0.05)
    print("READY", flush=True)
    ready = time.monotonic()
    evaluations, errors, first_true = 0, 0, None
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        details = client.get_boolean_details("new-checkout", True)
        evaluations += 1
        if details.reason == Reason.ERROR or details.error_code is not None:
            errors += 1
        if details.value is True and first_true is None:
            first_true = time.monotonic()
        time.sleep(0.05)
    print(json.dumps({
        "evaluations": evaluations,
        "errors": errors,
        "saw_the_change": first_true is not None,
        "change_seen_at": None if first_true is None else round(first_true - ready, 3),
    }), flush=True)
    api.shutdown()


if __name__ == "__main__":
    main()
