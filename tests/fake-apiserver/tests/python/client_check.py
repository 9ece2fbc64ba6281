"""Drives the fake API server with the official python `kubernetes` client.

Usage: client_check.py KUBECONFIG. Exits non-zero with a message on the first departure from
what the client needs; prints a JSON summary of what it saw on success.
"""

import json
import sys
import threading
import time

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

GROUP, VERSION, PLURAL, NS = "core.openfeature.dev", "v1beta1", "featureflags", "default"


def flag(name, variant):
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "FeatureFlag",
        "metadata": {"name": name, "labels": {"client": "python"}},
        "spec": {"flagSpec": {"flags": {"f": {
            "state": "ENABLED", "variants": {"on": True, "off": False}, "defaultVariant": variant,
        }}}},
    }


def expect_status(code, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except ApiException as e:
        assert e.status == code, f"expected {code}, got {e.status}: {e.reason} {e.body}"
        return e
    raise AssertionError(f"expected HTTP {code}, got success")


def main(kubeconfig):
    config.load_kube_config(config_file=kubeconfig)
    api = client.CustomObjectsApi()
    summary = {}

    created = api.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, flag("py", "on"))
    meta = created["metadata"]
    assert meta["uid"] and meta["creationTimestamp"] and meta["generation"] == 1, meta
    got = api.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "py")
    assert got == created, (got, created)

    merged = api.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "py",
        {"spec": {"flagSpec": {"flags": {"f": {"defaultVariant": "off"}}}}})
    assert merged["metadata"]["generation"] == 2, merged["metadata"]
    patched = api.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "py",
        [{"op": "add", "path": "/metadata/labels/extra", "value": "yes"}],
        _content_type="application/json-patch+json")
    assert patched["metadata"]["labels"]["extra"] == "yes", patched["metadata"]

    stale = dict(created)
    expect_status(409, api.replace_namespaced_custom_object, GROUP, VERSION, NS, PLURAL, "py", stale)
    expect_status(404, api.get_namespaced_custom_object, GROUP, VERSION, NS, PLURAL, "missing")
    expect_status(409, api.create_namespaced_custom_object, GROUP, VERSION, NS, PLURAL, flag("py", "on"))

    listed = api.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, label_selector="client=python")
    assert [i["metadata"]["name"] for i in listed["items"]] == ["py"], listed
    start_rv = listed["metadata"]["resourceVersion"]

    # A live watch from the list's resourceVersion sees a change and the delete.
    def writer():
        time.sleep(0.3)
        api.patch_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, "py",
            {"spec": {"flagSpec": {"flags": {"f": {"defaultVariant": "on"}}}}})
        api.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "py")

    threading.Thread(target=writer, daemon=True).start()
    w = watch.Watch()
    seen = []
    for event in w.stream(api.list_namespaced_custom_object, GROUP, VERSION, NS, PLURAL,
                          field_selector="metadata.name=py", resource_version=start_rv,
                          timeout_seconds=10):
        obj = event["object"]
        seen.append((event["type"], obj["spec"]["flagSpec"]["flags"]["f"]["defaultVariant"]))
        if event["type"] == "DELETED":
            w.stop()
    assert seen == [("MODIFIED", "on"), ("DELETED", "on")], seen
    summary["watch"] = seen
    expect_status(404, api.get_namespaced_custom_object, GROUP, VERSION, NS, PLURAL, "py")

    # A resourceVersion below the history floor: the ERROR event's 410 becomes an ApiException.
    w = watch.Watch()
    try:
        for _ in w.stream(api.list_namespaced_custom_object, GROUP, VERSION, NS, PLURAL,
                          resource_version="1"):
            pass
        raise AssertionError("expected 410 for a too-old resourceVersion")
    except ApiException as e:
        assert e.status == 410, e
        summary["expired"] = e.reason
    print(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1])
