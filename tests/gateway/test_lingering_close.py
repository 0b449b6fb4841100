"""The gateway's close of a connection whose request body it did not read (a 408 or 413 sent)
lingers with a FIN after the answer; when the client has already reset the connection, there
is nothing to linger for. That case raised from write_eof and logged two ERROR tracebacks per
client (a robustness audit: 17 among 60 partial bodies). Real sockets: the client resets while
the server's transport, not reading, has not yet seen it."""

from __future__ import annotations

import asyncio
import socket
import struct

from services.gateway.api.connections import LingeringClose


def test_a_client_that_reset_first_is_closed_without_an_error():
    async def scenario() -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()

        class Server(asyncio.Protocol):
            def connection_made(self, transport) -> None:
                transport.pause_reading()  # the reset stays unseen, as mid-request
                accepted.set_result(transport)

        server = await loop.create_server(Server, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        transport = await asyncio.wait_for(accepted, 5)
        # SO_LINGER 0: close() sends a reset, as a client that read its 408 and left.
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()
        await asyncio.sleep(0.1)
        wrapper = LingeringClose(transport, unread_body=lambda: True, loop=loop)
        wrapper.close()  # raised OSError [Errno 107] from write_eof
        closing = transport.is_closing()
        lingering = wrapper.lingering
        server.close()
        await server.wait_closed()
        return closing, lingering

    closing, lingering = asyncio.run(scenario())
    assert closing and not lingering
