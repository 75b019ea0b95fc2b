"""A WebSocket server that sends 1 MiB binary messages to every client for ever and reads nothing.

Run inside a sandbox (``python3 -c SOURCE PORT READY``, standard library only) by
bench/fairness.py and tests/test_edge_hostile.py: the edge's port proxy between it and a client
that never reads must hold a bounded number of bytes, whatever this sends.  It touches the file
READY once it listens on 127.0.0.1:PORT.
"""

import asyncio
import base64
import hashlib
import os
import sys

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455's handshake constant


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    key = next(line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
               if line.lower().startswith(b"sec-websocket-key:"))
    accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
    writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    payload = os.urandom(1 << 20)
    frame = bytes([0x82, 127]) + len(payload).to_bytes(8, "big") + payload
    try:
        while True:
            writer.write(frame)
            await writer.drain()
    except OSError:
        writer.close()


async def main(port: int, ready: str) -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    os.close(os.open(ready, os.O_CREAT | os.O_WRONLY, 0o644))  # listening: tell the caller
    await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
