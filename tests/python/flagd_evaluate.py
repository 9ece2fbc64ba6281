"""An unmodified OpenFeature flagd provider (Python, in-process resolver), configured only by the
FLAGD_* environment, that evaluates on command: for tests that change flags themselves (on a real
API server, with credentials this script does not hold).

Usage: flagd_evaluate.py < commands

It prints `ready SECONDS` once the provider is ready. Then, for each line on stdin
`expect FLAG VALUE` (VALUE as JSON: true, "red"), it evaluates FLAG until it gives VALUE and
prints `seen SECONDS`, or `timeout LAST` after 10 s; for `details FLAG` it prints FLAG's boolean
evaluation (default false) as one JSON object: value, variant, reason, error code. End of input
shuts it down.
"""

import json
import logging
import sys
import time

from openfeature import api
from openfeature.contrib.provider.flagd import FlagdProvider


def evaluate(client, flag, want):
    if isinstance(want, bool):
        return client.get_boolean_value(flag, not want)
    return client.get_string_value(flag, "")


def main():
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    started = time.monotonic()
    api.set_provider_and_wait(FlagdProvider(), "evaluate")
    client = api.get_client("evaluate")
    print(f"ready {time.monotonic() - started:.3f}", flush=True)
    for line in sys.stdin:
        if line.startswith("details "):
            d = client.get_boolean_details(line.split()[1], False)
            code = d.error_code.value if d.error_code else None
            print(json.dumps([d.value, d.variant, str(d.reason), code]), flush=True)
            continue
        _, flag, want = line.split(maxsplit=2)
        want = json.loads(want)
        asked = time.monotonic()
        value = evaluate(client, flag, want)
        while value != want and time.monotonic() - asked < 10:
            time.sleep(0.01)
            value = evaluate(client, flag, want)
        if value == want:
            print(f"seen {time.monotonic() - asked:.3f}", flush=True)
        else:
            print(f"timeout {json.dumps(value)}", flush=True)
    api.shutdown()


if __name__ == "__main__":
    main()
