"""The real gRPC C-core client (grpcio) balancing crd-broker streams over replicas with
`round_robin`: a `dns:///` target resolved by c-ares, as a headless Service is balanced, or an
`xds:///` target whose replicas the broker's xDS server pushes (the bootstrap in
`GRPC_XDS_BOOTSTRAP_CONFIG`; no code of the client's changes for it).

Usage: grpcio_balance.py TARGET STREAMS REQUEST_HEX MIN_RESOLUTION_MS [HOLD_MS]

Opens STREAMS Subscribe streams (the serialized SubscribeRequest REQUEST_HEX, sent as raw
bytes) on one channel to TARGET, once it is connected, 20 ms apart, and opens each again 100 ms
after it ends, as a client that follows the broker's UNAVAILABLE does. With HOLD_MS, each stream
is cancelled after that long (and opened again), so new streams keep coming, as sidecars
starting and stopping do. Prints one JSON line per stream end (`{"ended": code}`) and runs
until stdin closes. MIN_RESOLUTION_MS is the channel's
`grpc.dns_min_time_between_resolutions_ms` (0: the default, 30 s).
"""

import json
import sys
import threading
import time

import grpc


def main():
    target, streams, request_hex, min_resolution = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    hold = int(sys.argv[5]) / 1000 if len(sys.argv) > 5 else None
    request = bytes.fromhex(request_hex)
    options = [("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]}))]
    if min_resolution > 0:
        options.append(("grpc.dns_min_time_between_resolutions_ms", min_resolution))
    channel = grpc.insecure_channel(target, options=options)
    subscribe = channel.unary_stream(
        "/crdbroker.v1.Broker/Subscribe",
        request_serializer=None,
        response_deserializer=None,
    )
    lock = threading.Lock()
    stop = threading.Event()

    def follow():
        while not stop.is_set():
            try:
                call = subscribe(request, wait_for_ready=True)
                if hold is not None:
                    threading.Timer(hold, call.cancel).start()
                for _ in call:
                    if stop.is_set():
                        return
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            with lock:
                print(json.dumps({"ended": code}), flush=True)
            time.sleep(0.1)

    # round_robin picks among the subchannels that are READY: streams opened before the channel
    # has connected to every address all go to the first one that is. Let it connect, and open
    # them a little apart, as sidecars starting one by one do.
    grpc.channel_ready_future(channel).result(timeout=30)
    time.sleep(0.3)
    for _ in range(streams):
        threading.Thread(target=follow, daemon=True).start()
        time.sleep(0.02)
    print(json.dumps({"started": streams}), flush=True)
    sys.stdin.read()
    stop.set()


if __name__ == "__main__":
    main()
