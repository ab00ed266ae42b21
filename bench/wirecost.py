"""What a websocket message costs a control process around the code the simulator runs.

`bench/simulate.py --cross-check` compares the simulated coordinator (its handlers: parsing,
decisions, encoding) with a real one (`bench/scale.py`), whose process also pays aiohttp's
frames, the event loop's wake-ups and the hop to a worker thread that a large message is
parsed on (`sessions.parse_off_loop`). This measures those here, on loopback: a real aiohttp
server reads ``count`` text messages of a given size and hands each to `parse_off_loop` with
a parser that does nothing (the simulator charges the parsing), then sends ``count``. The
client is another process, so this process's CPU is the server's alone. Messages come a
millisecond apart, each waking the server's loop as a relay's batch does; the server sends
its own in a burst, as the coordinator sends each acknowledgement and order from the handler
that is already awake.

    python bench/wirecost.py 300 20000        # per message received and sent, at these sizes
"""

from __future__ import annotations

import asyncio
import sys
import time

from aiohttp import WSMsgType, web

from unbroken.control.sessions import parse_off_loop

CLIENT = """
import asyncio, sys, aiohttp
async def main(port, size, count):
    async with aiohttp.ClientSession() as s, s.ws_connect(f"http://127.0.0.1:{port}/", max_msg_size=0) as ws:
        text = "x" * size
        for _ in range(count):
            await ws.send_str(text)
            await asyncio.sleep(0.001)  # one at a time, as batches come: each wakes the server
        for _ in range(count):
            if (await ws.receive()).type != aiohttp.WSMsgType.TEXT:
                raise SystemExit("the server ended early")
asyncio.run(main(*map(int, sys.argv[1:])))
"""


def _ignored(text: str, limit: int) -> None:
    return None


async def _measure(size_in: int, size_out: int, count: int) -> tuple[float, float]:
    spent: dict[str, float] = {}
    done = asyncio.Event()

    async def serve(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=0, heartbeat=None)
        await ws.prepare(request)
        n, t0 = 0, 0.0
        async for raw in ws:
            if raw.type != WSMsgType.TEXT:
                break
            if n == 0:
                t0 = time.process_time()  # from the first message: the connection's set-up is not one
            await parse_off_loop(_ignored, raw.data, 1 << 30)
            n += 1
            if n == count:
                break
        spent["in"] = (time.process_time() - t0) / max(1, count - 1)
        text = "y" * size_out
        t0 = time.process_time()
        for _ in range(count):
            await ws.send_str(text)
        spent["out"] = (time.process_time() - t0) / count
        done.set()
        return ws

    app = web.Application()
    app.router.add_get("/", serve)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, str(port), str(size_in), str(count))
    await asyncio.wait_for(done.wait(), timeout=120)
    await client.wait()
    await runner.cleanup()
    return spent["in"], spent["out"]


def wire_costs(size_in: int, size_out: int, count: int = 3000) -> tuple[float, float]:
    """CPU seconds this process spends per message received of ``size_in`` bytes and per
    message sent of ``size_out``, aiohttp and the event loop included, parsing excluded."""
    return asyncio.run(_measure(max(1, size_in), max(1, size_out), count))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    rx, tx = wire_costs(int(sys.argv[1]), int(sys.argv[2]))
    print(f"received: {rx * 1e6:.1f} µs a message; sent: {tx * 1e6:.1f} µs a message")
