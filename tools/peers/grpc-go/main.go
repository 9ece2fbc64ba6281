// The real grpc-go client balancing crd-broker streams over replicas with the round_robin
// policy: grpc.NewClient with a `dns:` target, as a headless Service is balanced, or an `xds:`
// target whose replicas the broker's xDS server pushes (the bootstrap in
// GRPC_XDS_BOOTSTRAP_CONFIG; grpc-go's documented switch is the xds import below).
//
// Usage: grpc-go-client TARGET STREAMS REQUEST_HEX MIN_RESOLUTION_MS [HOLD_MS]
//
// Opens STREAMS Subscribe streams (the serialized SubscribeRequest REQUEST_HEX, sent as raw
// bytes) on one channel to TARGET, once it is connected, 20 ms apart, and opens each again
// 100 ms after it ends, as a client that follows the broker's UNAVAILABLE does. Prints one JSON
// line per stream end ({"ended": code}) and runs until stdin closes. MIN_RESOLUTION_MS is the
// DNS resolver's minimum time between resolutions (0: grpc-go's default, 30 s). With HOLD_MS,
// each stream is cancelled after that long (and opened again), so new streams keep coming.
//
// Three variables make it the Go flagd provider's connection instead:
//   - GRPC_GO_METHOD: the full method the streams call (default the broker's Subscribe), such
//     as /flagd.sync.v1.FlagSyncService/SyncFlags;
//   - GRPC_GO_KEEPALIVE_MS: client keepalive pings that often, on idle connections too
//     (PermitWithoutStream), as the Go provider pings every 30 s;
//   - GRPC_GO_SAY_MESSAGES=1: one JSON line per message ({"message": bytes}).
package main

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strconv"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/resolver/dns"
	"google.golang.org/grpc/status"
	_ "google.golang.org/grpc/xds"
)

var method = "/crdbroker.v1.Broker/Subscribe"

var sayMessages = os.Getenv("GRPC_GO_SAY_MESSAGES") == "1"

// raw passes messages through as the bytes they are: the client needs no generated code.
type raw struct{}

func (raw) Marshal(v any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(*v.(*[]byte))}, nil
}

func (raw) Unmarshal(data mem.BufferSlice, v any) error {
	*v.(*[]byte) = data.Materialize()
	return nil
}

func (raw) Name() string { return "proto" }

var out sync.Mutex

func say(v any) {
	line, _ := json.Marshal(v)
	out.Lock()
	defer out.Unlock()
	fmt.Println(string(line))
}

// follow opens the stream, reads it to its end, and opens it again 100 ms later.
func follow(conn *grpc.ClientConn, request []byte, hold time.Duration) {
	desc := &grpc.StreamDesc{ServerStreams: true}
	for {
		code := "OK"
		ctx, cancel := context.Background(), context.CancelFunc(func() {})
		if hold > 0 {
			ctx, cancel = context.WithTimeout(ctx, hold)
		}
		stream, err := conn.NewStream(ctx, desc, method,
			grpc.ForceCodecV2(raw{}), grpc.WaitForReady(true))
		if err == nil {
			err = stream.SendMsg(&request)
		}
		if err == nil {
			err = stream.CloseSend()
		}
		for err == nil {
			var message []byte
			err = stream.RecvMsg(&message)
			if err == nil && sayMessages {
				say(map[string]int{"message": len(message)})
			}
		}
		if err != io.EOF {
			code = status.Code(err).String()
		}
		cancel()
		say(map[string]string{"ended": code})
		time.Sleep(100 * time.Millisecond)
	}
}

func main() {
	if len(os.Args) != 5 && len(os.Args) != 6 {
		fmt.Fprintln(os.Stderr, "usage: grpc-go-client TARGET STREAMS REQUEST_HEX MIN_RESOLUTION_MS [HOLD_MS]")
		os.Exit(2)
	}
	var hold time.Duration
	if len(os.Args) == 6 {
		ms, err := strconv.Atoi(os.Args[5])
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		hold = time.Duration(ms) * time.Millisecond
	}
	target := os.Args[1]
	streams, err1 := strconv.Atoi(os.Args[2])
	request, err2 := hex.DecodeString(os.Args[3])
	minResolution, err3 := strconv.Atoi(os.Args[4])
	for _, err := range []error{err1, err2, err3} {
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
	}
	if minResolution > 0 {
		dns.SetMinResolutionInterval(time.Duration(minResolution) * time.Millisecond)
	}
	if m := os.Getenv("GRPC_GO_METHOD"); m != "" {
		method = m
	}
	options := []grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultServiceConfig(`{"loadBalancingConfig": [{"round_robin": {}}]}`),
	}
	if ms := os.Getenv("GRPC_GO_KEEPALIVE_MS"); ms != "" {
		every, err := strconv.Atoi(ms)
		if err != nil {
			fmt.Fprintln(os.Stderr, "GRPC_GO_KEEPALIVE_MS:", err)
			os.Exit(2)
		}
		options = append(options, grpc.WithKeepaliveParams(keepalive.ClientParameters{
			Time:                time.Duration(every) * time.Millisecond,
			Timeout:             20 * time.Second,
			PermitWithoutStream: true,
		}))
	}
	conn, err := grpc.NewClient(target, options...)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	// round_robin picks among the subchannels that are READY: let it connect to every address,
	// then open the streams a little apart, as sidecars starting one by one do.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	conn.Connect()
	for state := conn.GetState(); state != connectivity.Ready; state = conn.GetState() {
		if !conn.WaitForStateChange(ctx, state) {
			fmt.Fprintln(os.Stderr, "not ready within 30 s")
			os.Exit(1)
		}
	}
	cancel()
	time.Sleep(300 * time.Millisecond)
	for i := 0; i < streams; i++ {
		go follow(conn, request, hold)
		time.Sleep(20 * time.Millisecond)
	}
	say(map[string]int{"started": streams})
	io.Copy(io.Discard, os.Stdin)
}
