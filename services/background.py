"""An asyncio event loop on a daemon thread, to host `grpc.aio` servers inside a synchronous program
(tests, benchmarks, notebooks): `loop.run(create_expert_server(...))` starts a server there."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine


class BackgroundLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Run a coroutine on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self.loop.is_running():
            self.loop.close()

    def __enter__(self) -> BackgroundLoop:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
