// The real @grpc/grpc-js client balancing crd-broker streams as a headless Service is
// balanced: a `dns:` target and `round_robin` (the test sets GRPC_NODE_USE_ALTERNATIVE_RESOLVER,
// without which grpc-js ignores a DNS server named in the target).
//
// Usage: node dns_balance.js TARGET STREAMS REQUEST_HEX MIN_RESOLUTION_MS
//
// Opens STREAMS Subscribe streams (the serialized SubscribeRequest REQUEST_HEX, sent as raw
// bytes) on one channel to TARGET, once it is connected, 20 ms apart, and opens each again
// 100 ms after it ends. Prints one JSON line per stream end and runs until stdin closes.
// MIN_RESOLUTION_MS is `grpc.dns_min_time_between_resolutions_ms` (0: the default, 30 s).
'use strict';

const grpc = require('@grpc/grpc-js');

const [target, streamsArg, requestHex, minResolution] = process.argv.slice(2);
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
