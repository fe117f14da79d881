"""The S3 endpoint in front of moto: a TCP forwarder that can be stopped while moto keeps the buckets.

A real S3 outage loses no data; moto keeps its objects in memory, so stopping moto itself would.  The stack's
endpoint (``http://<srv>:9000``) is this forwarder to moto on the host's loopback: stopping it is an outage
(connections refused), starting it again brings back the same buckets.

    python -m stack.endpoint LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT
"""

from __future__ import annotations

import asyncio
import contextlib
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _serve(listen: str, port: int, target: str, target_port: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(target, target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(handle, listen, port)
    async with server:
        await server.serve_forever()


def main() -> None:
    listen, port, target, target_port = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    asyncio.run(_serve(listen, port, target, target_port))


if __name__ == "__main__":
    main()
