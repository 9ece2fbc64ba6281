"""An unmodified OpenFeature flagd provider (Python, in-process resolver) configured exactly as the
OpenFeature Operator configures a workload: only the environment an InProcessConfiguration
injects (FLAGD_HOST, FLAGD_PORT, FLAGD_TLS, FLAGD_CACHE, FLAGD_MAX_CACHE_SIZE, FLAGD_RESOLVER,
FLAGD_SOURCE_SELECTOR; no FLAGD_SYNC_PORT).

Usage: flagd_operator_check.py FAKE_API_SERVER_URL NAMESPACE NAME

The FeatureFlag NAMESPACE/NAME has the boolean flag `f` on when this starts. The check becomes
ready, evaluates `f`, turns it off through the fake API server and waits for the provider to
evaluate the change. The last line printed is a JSON summary; any departure raises and the exit
status is non-zero.
"""

import json
import logging
import sys
import time
import urllib.request

from openfeature import api
from openfeature.contrib.provider.flagd import FlagdProvider


def main():
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    fake, namespace, name = sys.argv[1:4]
    started = time.monotonic()
    api.set_provider_and_wait(FlagdProvider(), "operator")
    summary = {"ready_seconds": round(time.monotonic() - started, 3)}
    client = api.get_client("operator")
    details = client.get_boolean_details("f", False)
    assert details.value is True and details.error_code is None, details

    url = f"{fake}/apis/core.openfeature.dev/v1beta1/namespaces/{namespace}/featureflags/{name}"
    body = json.dumps({"spec": {"flagSpec": {"flags": {"f": {"defaultVariant": "off"}}}}}).encode()
    request = urllib.request.Request(
        url, data=body, method="PATCH", headers={"Content-Type": "application/merge-patch+json"}
    )
    urllib.request.urlopen(request).read()
    patched = time.monotonic()
    while client.get_boolean_value("f", True) is not False:
        if time.monotonic() - patched > 10:
            raise AssertionError("the provider did not see the change within 10 s")
        time.sleep(0.01)
    summary["patch_to_evaluation_seconds"] = round(time.monotonic() - patched, 3)
    api.shutdown()
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
