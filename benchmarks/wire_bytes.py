"""Bytes a coordinator sends an expert replica per stream, through a byte-counting TCP proxy in front of
a real expert server (a tiny random expert: the request bytes do not depend on the model). One session
decodes N tokens greedily through `RemoteExpert.step`, as the engine steps it; measured with the
wire as it is (a decoding session sends its new ids, `SessionStep.known_length`) and, side by side in
the same run, with every Step sending the whole history (as before). Answers (the logits) are not
counted: they are one row per step either way.

    python benchmarks/wire_bytes.py [--tokens 50,400] [--json benchmarks/results/wire_bytes.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class CountingProxy:
    """A TCP proxy on a loopback port that counts the bytes going to the server."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.sent = 0
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def pipe(reader, writer, count: bool) -> None:
            try:
                while data := await reader.read(65536):
                    if count:
                        self.sent += len(data)
                    writer.write(data)
                    await writer.drain()
            finally:
                writer.close()

        async def handle(client_reader, client_writer) -> None:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            await asyncio.gather(pipe(client_reader, server_writer, True), pipe(server_reader, client_writer, False),
                                 return_exceptions=True)

        async def start() -> None:
            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()


def main() -> None:
    from fusion.config import parse_config
    from fusion.experts.expert import LocalExpert, StepRequest
    from fusion.services.expert_server import create_expert_server
    from fusion.services.remote_expert import RemoteExpert
    from tests.conftest import BackgroundLoop, tiny_config_dict
    from tests.tiny_models import make_model, make_tokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="50,400")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    lengths = [int(n) for n in args.tokens.split(",")]
    root = Path(tempfile.mkdtemp())
    make_model(root / "a", make_tokenizer(root / "tok"), seed=1, positions=max(lengths) + 64)
    config = parse_config(tiny_config_dict(root, names=("a",), limits={"max_prompt_tokens": 4096}))
    results = {}
    with BackgroundLoop() as loop:
        server, port = loop.run(create_expert_server(LocalExpert.load(config.expert("a")), config.limits))
        try:
            for wire in ("new ids", "whole history"):
                for n in lengths:
                    proxy = CountingProxy(port)
                    expert = RemoteExpert(config.expert("a").model_copy(update={"addresses": [f"127.0.0.1:{proxy.port}"]}))
                    if wire == "whole history":
                        expert._known_length = lambda index, request: 0  # every Step sends the history whole
                    session, history = f"{wire}-{n}", [5, 17, 42, 99, 3, 250, 8, 61]
                    before = proxy.sent
                    for _ in range(n):
                        [row] = expert.step([StepRequest(session, history)])
                        history.append(int(row.argmax()))
                    results.setdefault(wire, {})[n] = proxy.sent - before
                    expert.release([session])
                    expert.close()
                    print(f"{wire:13} {n:4} tokens: {results[wire][n]:8,} bytes sent", flush=True)
        finally:
            loop.run(server.stop(0))
    summary = {wire: {"bytes": by_n, "growth": round(by_n[lengths[-1]] / by_n[lengths[0]], 1)}
               for wire, by_n in results.items()}
    print(json.dumps({"tokens": lengths, **summary}))
    if args.json:
        args.json.write_text(json.dumps({"date": date.today().isoformat(), "tokens": lengths, **summary}, indent=2))


if __name__ == "__main__":
    main()
