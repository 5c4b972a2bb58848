"""The test control plane's second transport: the gRPC project's own server (grpcio, asyncio
API) serving delta ADS and state-of-the-world SDS with Envoy's generated Python protos
(PyPI `xds-protos`).

Every byte on the client's connection is written by grpcio and Python's protobuf: HTTP/2,
the moment response headers go out (with the first response message, grpcio's default, as
grpc-go and gRPC C++ do), flow control, GOAWAY on a graceful stop, status codes. What to answer
is decided by the test's control plane state (`state.rs`), the same as behind the tonic
transport, so a test gives the same answers on both and any difference is the transport's.
Each RPC is relayed to that state over one connection to the `--backend` unix socket, in
frames of a kind byte, a big-endian u32 length and the bytes:

  to the state:   O ("ads" | "sds")   the RPC opened
                  M <request>        a request message, as protobuf bytes
                  (end of stream)    the client half-closed; closing the socket: the RPC ended
  from the state: M <response>       a response message, as protobuf bytes
                  E <u32 code><text> the RPC ends with this gRPC status (0: OK)

Usage: grpcio_control_plane.py --listen HOST:PORT|unix:PATH --backend PATH [--grace SECONDS]
Prints "serving" once it accepts connections. SIGTERM stops it gracefully (GOAWAY, then open
RPCs are cancelled after the grace period); SIGKILL is a crash.
"""

import argparse
import asyncio
import signal
import struct
import sys

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc

STATUS = {code.value[0]: code for code in grpc.StatusCode}


def frame(kind, payload):
    return kind + struct.pack(">I", len(payload)) + payload


async def read_frame(reader):
    head = await reader.readexactly(5)
    (length,) = struct.unpack(">I", head[1:])
    return head[:1], await reader.readexactly(length)


async def relay(backend, api, request_iterator, context, response_type):
    reader, writer = await asyncio.open_unix_connection(backend)
    writer.write(frame(b"O", api))

    async def forward_requests():
        try:
            async for request in request_iterator:
                writer.write(frame(b"M", request.SerializeToString()))
                await writer.drain()
            writer.write_eof()
        except (ConnectionError, grpc.aio.AioRpcError):
            pass

    pump = asyncio.ensure_future(forward_requests())
    try:
        while True:
            try:
                kind, payload = await read_frame(reader)
            except asyncio.IncompleteReadError:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the test state went away")
            if kind == b"M":
                yield response_type.FromString(payload)
            elif kind == b"E":
                (code,) = struct.unpack(">I", payload[:4])
                if code != 0:
                    await context.abort(STATUS[code], payload[4:].decode())
                return
    finally:
        pump.cancel()
        writer.close()


class Ads(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, backend):
        self.backend = backend

    async def DeltaAggregatedResources(self, request_iterator, context):
        response_type = discovery_pb2.DeltaDiscoveryResponse
        async for r in relay(self.backend, b"ads", request_iterator, context, response_type):
            yield r


class Sds(sds_pb2_grpc.SecretDiscoveryServiceServicer):
    def __init__(self, backend):
        self.backend = backend

    async def StreamSecrets(self, request_iterator, context):
        response_type = discovery_pb2.DiscoveryResponse
        async for r in relay(self.backend, b"sds", request_iterator, context, response_type):
            yield r


async def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--grace", type=float, default=1.0)
    args = parser.parse_args()

    server = grpc.aio.server()
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(Ads(args.backend), server)
    sds_pb2_grpc.add_SecretDiscoveryServiceServicer_to_server(Sds(args.backend), server)
    if server.add_insecure_port(args.listen) == 0 and not args.listen.startswith("unix:"):
        sys.exit(f"cannot listen on {args.listen}")
    await server.start()
    print("serving", flush=True)

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(args.grace)


if __name__ == "__main__":
    asyncio.run(main())
