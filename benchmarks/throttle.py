"""A TCP proxy on 127.0.0.1 that paces what a server sends to each connection.

``python -m benchmarks.throttle LISTEN_PORT TARGET_PORT MB_PER_S`` forwards every connection
to ``127.0.0.1:TARGET_PORT``: what the client sends goes through as it comes, what the server
answers reaches the client at ``MB_PER_S`` (10**6 bytes a second) per connection at most. An
object store serves each connection at a rate of its own and scales with the number of
connections (S3 and GCS: tens of MB/s each), so a client's rate is set by the network and how
many GETs it keeps running, not by the CPU it spends: the regime a loader meets in training,
which the S3 server on the same 2 cores as the client (``benchmarks.remote``) does not show.
It prints ``ready`` once it listens; it runs until killed.

>>> pace = Pace(1e6)
>>> pace.wait(500_000, now=10.0), pace.wait(500_000, now=10.0), pace.wait(250_000, now=12.0)
(0.5, 1.0, 0.25)
"""

from __future__ import annotations

import asyncio
import sys

_CHUNK = 64 << 10  # bytes forwarded at a time


class Pace:
    """When the bytes of one connection may go: ``bytes_per_s`` at most, no credit saved up
    while the connection is idle."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self._due = 0.0

    def wait(self, num_bytes: int, now: float) -> float:
        """Seconds from ``now`` until ``num_bytes`` more have gone at the rate: the time to
        wait before sending them."""
        self._due = max(self._due, now) + num_bytes / self.bytes_per_s
        return self._due - now


async def _pipe(
    source: asyncio.StreamReader, sink: asyncio.StreamWriter, pace: Pace | None
) -> None:
    loop = asyncio.get_running_loop()
    try:
        while data := await source.read(_CHUNK):
            if pace is not None:
                delay = pace.wait(len(data), loop.time())
                await asyncio.sleep(delay)
            sink.write(data)
            await sink.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        sink.close()


async def _serve(listen_port: int, target_port: int, bytes_per_s: float) -> None:
    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            _pipe(reader, up_writer, None), _pipe(up_reader, writer, Pace(bytes_per_s))
        )

    server = await asyncio.start_server(connection, "127.0.0.1", listen_port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    listen_port, target_port, mb_per_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    asyncio.run(_serve(listen_port, target_port, mb_per_s * 1e6))


if __name__ == "__main__":
    main()
