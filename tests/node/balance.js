// The real @grpc/grpc-js client balancing crd-broker streams over replicas with `round_robin`:
// a `dns:` target, as a headless Service is balanced (the test sets
// GRPC_NODE_USE_ALTERNATIVE_RESOLVER, without which grpc-js ignores a DNS server named in the
// target), or an `xds:` target whose replicas the broker's xDS server pushes (the bootstrap in
// GRPC_XDS_BOOTSTRAP_CONFIG; grpc-js's documented switch is @grpc/grpc-js-xds's register()).
//
// Usage: node balance.js TARGET STREAMS REQUEST_HEX MIN_RESOLUTION_MS [HOLD_MS]
//
// Opens STREAMS Subscribe streams (the serialized SubscribeRequest REQUEST_HEX, sent as raw
// bytes) on one channel to TARGET, once it is connected, 20 ms apart, and opens each again
// 100 ms after it ends. Prints one JSON line per stream end and runs until stdin closes.
// MIN_RESOLUTION_MS is `grpc.dns_min_time_between_resolutions_ms` (0: the default, 30 s). With
// HOLD_MS, each stream is cancelled after that long (and opened again), so new streams keep
// coming.
'use strict';

const grpc = require('@grpc/grpc-js');

const [target, streamsArg, requestHex, minResolution, holdMs] = process.argv.slice(2);
if (target.startsWith('xds:')) {
  require('@grpc/grpc-js-xds').register();
}
const options = {
  'grpc.service_config': JSON.stringify({ loadBalancingConfig: [{ round_robin: {} }] }),
};
if (Number(minResolution) > 0) {
  options['grpc.dns_min_time_between_resolutions_ms'] = Number(minResolution);
}
const client = new grpc.Client(target, grpc.credentials.createInsecure(), options);
const request = Buffer.from(requestHex, 'hex');
const raw = (bytes) => bytes;

function follow() {
  const call = client.makeServerStreamRequest(
    '/crdbroker.v1.Broker/Subscribe',
    raw,
    raw,
    request,
    new grpc.Metadata(),
    { waitForReady: true },
  );
  if (Number(holdMs) > 0) {
    setTimeout(() => call.cancel(), Number(holdMs));
  }
  call.on('data', () => {});
  call.on('error', () => {});
  call.on('status', (status) => {
    console.log(JSON.stringify({ ended: grpc.status[status.code] }));
    setTimeout(follow, 100);
  });
}

client.waitForReady(Date.now() + 30000, (error) => {
  if (error) {
    console.error(`not ready: ${error.message}`);
    process.exit(1);
  }
  // round_robin picks among the addresses already connected: let it connect to all of them.
  setTimeout(() => {
    for (let i = 0; i < Number(streamsArg); i += 1) {
      setTimeout(follow, i * 20);
    }
    console.log(JSON.stringify({ started: Number(streamsArg) }));
  }, 300);
});

process.stdin.on('end', () => process.exit(0));
process.stdin.resume();
