"""An HTTP front's transport sends the writes of one event-loop turn as one send."""

from __future__ import annotations

import asyncio
import socket

from infermux.serve.http import CoalescingTransport


class _Sink(asyncio.Protocol):
    """The far end: everything received, and when the connection ended."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.data += data

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


async def _pair() -> tuple[CoalescingTransport, list[bytes], _Sink]:
    """A coalescing transport over a real socket pair, its real sends, the far end."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    transport, _ = await loop.create_connection(asyncio.Protocol, sock=ours)
    sends: list[bytes] = []
    real_write = transport.write

    def counted(data: bytes) -> None:  # the real transport's write, counted
        sends.append(bytes(data))
        real_write(data)

    transport.write = counted  # type: ignore[method-assign,assignment]
    sink = _Sink()
    await loop.create_connection(lambda: sink, sock=theirs)
    return CoalescingTransport(transport, loop), sends, sink


def test_writes_of_one_turn_leave_in_one_send() -> None:
    async def main() -> tuple[list[bytes], bytes]:
        coalescing, sends, sink = await _pair()
        coalescing.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n")
        coalescing.write(b"hello")
        assert sends == []  # held until the turn ends
        await asyncio.sleep(0.05)
        coalescing.write(b"next")  # a later turn: a send of its own
        await asyncio.sleep(0.05)
        coalescing.close()
        await asyncio.wait_for(sink.closed, 5)
        return sends, bytes(sink.data)

    sends, received = asyncio.run(main())
    assert sends == [b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello", b"next"]
    assert received == b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhellonext"


def test_close_sends_what_is_held_first() -> None:
    async def main() -> bytes:
        coalescing, sends, sink = await _pair()
        coalescing.write(b"HTTP/1.1 500 Internal Server Error\r\n\r\n")
        coalescing.close()  # in the same turn: uvicorn's error path writes, then closes
        await asyncio.wait_for(sink.closed, 5)
        assert coalescing.is_closing()  # the wrapped transport's own attribute
        coalescing.write(b"late")  # after close: dropped when the turn ends, no error
        await asyncio.sleep(0.05)
        assert sends == [b"HTTP/1.1 500 Internal Server Error\r\n\r\n"]
        return bytes(sink.data)

    assert asyncio.run(main()) == b"HTTP/1.1 500 Internal Server Error\r\n\r\n"


def test_large_writes_are_sent_as_they_came() -> None:
    async def main() -> tuple[list[bytes], int]:
        coalescing, sends, sink = await _pair()
        body = bytes(200_000)  # joining it to its headers would copy it to save one send
        coalescing.write(b"HTTP/1.1 200 OK\r\ncontent-length: 200000\r\n\r\n")
        coalescing.write(body)
        await asyncio.sleep(0.05)
        coalescing.close()
        await asyncio.wait_for(sink.closed, 5)
        return sends, len(sink.data)

    headers = b"HTTP/1.1 200 OK\r\ncontent-length: 200000\r\n\r\n"
    sends, received = asyncio.run(main())
    assert [len(s) for s in sends] == [len(headers), 200_000]
    assert received == len(headers) + 200_000
