"""Opens idle downstream connections to an outbound listener and keeps them open.

    python3 benches/idle.py HOST:PORT AUTHORITY COUNT h1|h2|tcp:KIB

Each connection makes one request first, so the proxy has built everything a used connection
holds (HTTP/1 buffers, or the h2 connection with its HPACK tables and windows), then stays
idle. With tcp:KIB, each is a CONNECT tunnel to AUTHORITY (a tcp port) that first sends KIB
KiB through it and waits for the app's one-byte acknowledgement (`benches/idle.sh` runs such
an app), so the sidecars have grown what bulk grows. Prints "open N" once all are answered,
then waits for stdin to close, then prints how many the proxy had closed meanwhile. Loopback
only.
"""

import asyncio
import sys

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(kind, flags, stream, payload=b""):
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def h2_request(authority):
    # HPACK: :method GET, :scheme http, :path / from the static table; :authority as a literal
    # without indexing (name index 1).
    a = authority.encode()
    block = b"\x82\x86\x84" + b"\x01" + bytes([len(a)]) + a
    return PREFACE + frame(4, 0, 0) + frame(1, 0x05, 1, block)


async def one(host, port, authority, proto):
    r, w = await asyncio.open_connection(host, port)
    if proto.startswith("tcp:"):
        w.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        head = await r.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head[:64]
        w.write(b"\xab" * (int(proto[4:]) * 1024))
        await w.drain()
        assert await r.readexactly(1) == b"k"
    elif proto == "h1":
        w.write(f"GET / HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        head = await r.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head[:64]
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await r.readexactly(length)
    else:
        w.write(h2_request(authority))
        # Frames until stream 1 ends (END_STREAM on DATA or HEADERS); SETTINGS get their ACK.
        while True:
            hdr = await r.readexactly(9)
            n, kind, flags = int.from_bytes(hdr[:3], "big"), hdr[3], hdr[4]
            stream = int.from_bytes(hdr[5:9], "big") & 0x7FFFFFFF
            await r.readexactly(n)
            if kind == 4 and not flags & 1:
                w.write(frame(4, 1, 0))
            if kind == 1 and stream == 1:
                assert flags & 0x04, "status in a CONTINUATION"
            if kind in (0, 1) and stream == 1 and flags & 0x01:
                break
    await w.drain()
    return r, w


async def main():
    host, port = sys.argv[1].rsplit(":", 1)
    authority, count, proto = sys.argv[2], int(sys.argv[3]), sys.argv[4]
    conns = []
    # Bulk tunnels a few at a time, so each one's transfer is a burst the sidecars read in full.
    step = 8 if proto.startswith("tcp:") else 200
    for start in range(0, count, step):
        batch = [one(host, int(port), authority, proto) for _ in range(min(step, count - start))]
        conns += await asyncio.gather(*batch)
    print("open", len(conns), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    closed = sum(1 for r, _ in conns if r.at_eof())
    print("closed by the proxy meanwhile", closed, flush=True)
    for _, w in conns:
        w.close()


asyncio.run(main())
