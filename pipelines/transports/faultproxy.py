"""A TCP fault proxy (asyncio) between Kafka clients and brokers: per-link added latency and cuts.

A link listens on a local port and forwards every connection to one upstream ``host:port`` (one link per broker
and client path: Kafka clients connect to the brokers' advertised addresses after bootstrap, so each broker's
advertised port of a path must be a link of the proxy; ``infra/local/kafka.sh start --brokers N --listener
NAME=A1,...`` advertises such ports and writes them to ``<state-dir>/listeners``, see `links_from_kafka_state`).

Faults, applied to the links whose names match a shell pattern (``fnmatch``):

- ``latency(pattern, seconds)``: every chunk is delivered that much later, in both directions, in order;
- ``cut(pattern, seconds=None, mode="refuse")``: close the link's connections now, then for ``seconds`` (until
  ``restore`` when None) either refuse new ones (``refuse``: the port stops listening, connects fail at once) or
  accept and hold them without forwarding a byte (``blackhole``: a network partition, clients time out);
- ``restore(pattern)``: end a cut early.

In-process use (tests): ``FaultProxy(links).start()`` runs the event loop in a daemon thread; every method is
thread-safe. Command line: ``python -m pipelines.transports.faultproxy --kafka-state DIR [--control PORT]``
serves the links until interrupted; the control port takes one command per line (``cut PATTERN [SECONDS]
[refuse|blackhole]``, ``latency PATTERN MS``, ``restore PATTERN``, ``status``) and answers one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import fnmatch
import json
import sys
import threading
import time
from pathlib import Path

CHUNK = 256 * 1024
CUT_MODES = ("refuse", "blackhole")


@dataclasses.dataclass
class Link:
    """One listening port forwarded to one upstream address, and its faults."""

    name: str
    listen_port: int
    upstream: tuple[str, int]
    latency_s: float = 0.0
    cut_mode: str | None = None          # None: connected; "refuse" / "blackhole" while cut
    cut_until: float | None = None       # monotonic end of a timed cut
    accepted: int = 0
    refused: int = 0                     # connections held by a blackhole or failed upstream
    bytes_up: int = 0                    # client -> broker
    bytes_down: int = 0
    cuts: int = 0
    dropped: int = 0                     # connections a cut closed
    server: asyncio.AbstractServer | None = dataclasses.field(default=None, repr=False)
    conns: set = dataclasses.field(default_factory=set, repr=False)

    def status(self) -> dict:
        return {"listen": self.listen_port, "upstream": f"{self.upstream[0]}:{self.upstream[1]}",
                "latency_ms": self.latency_s * 1000, "cut": self.cut_mode, "accepted": self.accepted,
                "refused": self.refused, "open": len(self.conns), "bytes_up": self.bytes_up,
                "bytes_down": self.bytes_down, "cuts": self.cuts, "dropped": self.dropped}


def links_from_kafka_state(state_dir: str | Path, names: list[str] | None = None) -> dict[str, tuple[int, str, int]]:
    """Links for the advertised client listeners of a `kafka.sh --brokers N --listener ...` cluster:
    ``{"<name>-<node>": (advertised_port, "127.0.0.1", broker_port)}`` (listeners advertised as themselves,
    PLAINTEXT, are direct paths and get no link). names: only these listener names (case-insensitive)."""
    path = Path(state_dir) / "listeners"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: start the cluster with infra/local/kafka.sh start --brokers N "
                                f"--listener NAME=PORTS first")
    want = {n.upper() for n in names} if names else None
    out = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        name, node, port, adv = line.split()
        if adv == port or (want is not None and name not in want):
            continue
        out[f"{name.lower()}-{node}"] = (int(adv), "127.0.0.1", int(port))
    return out


class FaultProxy:
    """The links {name: (listen_port, upstream_host, upstream_port)} served by one asyncio loop."""

    def __init__(self, links: dict[str, tuple[int, str, int]], host: str = "127.0.0.1"):
        self.host = host
        self.links = {n: Link(n, int(p), (h, int(up))) for n, (p, h, up) in links.items()}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> "FaultProxy":
        ready = threading.Event()
        errors: list[BaseException] = []

        def main():
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self._open_all())
            except BaseException as e:  # a port in use: reported by start()
                errors.append(e)
                ready.set()
                return
            timer = self.loop.create_task(self._timer())
            ready.set()
            self.loop.run_forever()
            timer.cancel()
            self.loop.run_until_complete(asyncio.gather(timer, return_exceptions=True))
            self.loop.close()

        self._thread = threading.Thread(target=main, daemon=True, name="faultproxy")
        self._thread.start()
        ready.wait()
        if errors:
            raise errors[0]
        return self

    def stop(self) -> None:
        if self.loop is None:
            return
        self._call(self._close_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _call(self, coro):
        """Run a coroutine on the proxy's loop from another thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def _match(self, pattern: str) -> list[Link]:
        got = [l for n, l in self.links.items() if fnmatch.fnmatchcase(n, pattern)]
        if not got:
            raise KeyError(f"no link matches {pattern!r} (links: {', '.join(sorted(self.links))})")
        return got

    # ------------------------------------------------------------------------------------------ faults
    def latency(self, pattern: str, seconds: float) -> None:
        for link in self._match(pattern):
            link.latency_s = max(0.0, float(seconds))

    def cut(self, pattern: str, seconds: float | None = None, mode: str = "refuse") -> None:
        if mode not in CUT_MODES:
            raise ValueError(f"cut mode must be one of {CUT_MODES}, got {mode!r}")
        links = self._match(pattern)
        self._call(self._cut(links, seconds, mode))

    def restore(self, pattern: str) -> None:
        self._call(self._restore(self._match(pattern)))

    def status(self) -> dict:
        return {n: l.status() for n, l in sorted(self.links.items())}

    # ------------------------------------------------------------------------------------------ loop side
    async def _open_all(self):
        for link in self.links.values():
            await self._listen(link)

    async def _listen(self, link: Link):
        link.server = await asyncio.start_server(lambda r, w, l=link: self._serve(l, r, w), self.host,
                                                 link.listen_port, reuse_address=True)

    async def _close_all(self):
        for link in self.links.values():
            self._drop(link)
            if link.server is not None:
                link.server.close()
                link.server = None

    def _drop(self, link: Link) -> None:
        for w in list(link.conns):
            w.transport.abort()  # RST: the peer sees the connection die, as on a broken network
        link.conns.clear()

    async def _cut(self, links, seconds, mode):
        until = None if seconds is None else time.monotonic() + float(seconds)
        for link in links:
            link.cut_mode, link.cut_until = mode, until
            link.cuts += 1
            link.dropped += len(link.conns)
            self._drop(link)
            if mode == "refuse" and link.server is not None:
                link.server.close()
                link.server = None

    async def _restore(self, links):
        for link in links:
            if link.cut_mode is None:
                continue
            link.cut_mode, link.cut_until = None, None
            self._drop(link)  # connections a blackhole held
            if link.server is None:
                await self._listen(link)

    async def _timer(self):
        while True:
            now = time.monotonic()
            due = [l for l in self.links.values() if l.cut_until is not None and l.cut_until <= now]
            if due:
                await self._restore(due)
            await asyncio.sleep(0.05)

    async def _serve(self, link: Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        link.conns.add(writer)
        if link.cut_mode is not None:  # a blackhole: hold the connection, forward nothing
            link.refused += 1
            return
        link.accepted += 1
        try:
            ur, uw = await asyncio.open_connection(*link.upstream)
        except OSError:  # the broker is down: the client sees the connection close, as with no proxy
            link.refused += 1
            link.conns.discard(writer)
            writer.transport.abort()
            return
        link.conns.add(uw)
        up = asyncio.ensure_future(self._pump(link, reader, uw, "bytes_up"))
        down = asyncio.ensure_future(self._pump(link, ur, writer, "bytes_down"))
        await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        for task in (up, down):
            task.cancel()
        for w in (writer, uw):
            link.conns.discard(w)
            w.transport.abort()

    async def _pump(self, link: Link, reader, writer, counter: str):
        """Copy one direction; with latency, each chunk leaves `latency_s` after it arrived, in order."""
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver():
            while True:
                due, data = await queue.get()
                if data is None:
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
                setattr(link, counter, getattr(link, counter) + len(data))

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                await queue.put((time.monotonic() + link.latency_s, data))
            await queue.put((0.0, None))
            await sender
        except (ConnectionError, OSError):
            pass
        finally:
            sender.cancel()


# ---------------------------------------------------------------------------------------------- command line
def _command(proxy: FaultProxy, line: str) -> dict:
    words = line.split()
    if not words:
        return {"error": "empty command"}
    op, args = words[0], words[1:]
    try:
        if op == "status":
            return proxy.status()
        if op == "latency" and len(args) == 2:
            proxy.latency(args[0], float(args[1]) / 1000)
        elif op == "cut" and 1 <= len(args) <= 3:
            secs = float(args[1]) if len(args) > 1 and args[1] != "-" else None
            proxy.cut(args[0], secs, args[2] if len(args) > 2 else "refuse")
        elif op == "restore" and len(args) == 1:
            proxy.restore(args[0])
        else:
            return {"error": f"unknown command {line.strip()!r} (cut PATTERN [SECONDS] [refuse|blackhole], "
                             f"latency PATTERN MS, restore PATTERN, status)"}
    except (KeyError, ValueError) as e:
        return {"error": str(e)}
    return {"ok": True}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.transports.faultproxy", description=__doc__.splitlines()[0])
    ap.add_argument("--kafka-state", help="a kafka.sh cluster's state dir: one link per advertised listener port")
    ap.add_argument("--listener", action="append", help="only these listener names (with --kafka-state)")
    ap.add_argument("--link", action="append", default=[], metavar="NAME=LISTEN_PORT:HOST:PORT",
                    help="a link (repeatable)")
    ap.add_argument("--control", type=int, help="control port on 127.0.0.1 (one command per line)")
    args = ap.parse_args(argv)
    links = links_from_kafka_state(args.kafka_state, args.listener) if args.kafka_state else {}
    for spec in args.link:
        try:
            name, rest = spec.split("=", 1)
            port, host, up = rest.split(":")
            links[name] = (int(port), host, int(up))
        except ValueError:
            print(f"faultproxy: --link wants NAME=LISTEN_PORT:HOST:PORT, got {spec!r}", file=sys.stderr)
            return 2
    if not links:
        print("faultproxy: no links (give --kafka-state DIR or --link ...)", file=sys.stderr)
        return 2
    proxy = FaultProxy(links).start()
    for n, l in sorted(proxy.links.items()):
        print(f"{n}: 127.0.0.1:{l.listen_port} -> {l.upstream[0]}:{l.upstream[1]}", flush=True)

    async def control(reader, writer):
        while line := (await reader.readline()).decode():
            reply = await asyncio.get_running_loop().run_in_executor(None, _command, proxy, line)
            writer.write((json.dumps(reply) + "\n").encode())
            await writer.drain()
        writer.close()

    try:
        if args.control:
            async def serve():
                server = await asyncio.start_server(control, "127.0.0.1", args.control)
                print(f"control: 127.0.0.1:{args.control}", flush=True)
                async with server:
                    await server.serve_forever()
            asyncio.run(serve())
        else:
            threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
