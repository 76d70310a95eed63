"""Whether torch's CUDA-graph trees (`torch.compile(mode="reduce-overhead")`, what `decode: compiled` runs on a
GPU) work on a thread other than the one that imported them. torch 2.11 kept the trees' state in the
importing thread only and asserted elsewhere (docs/performance.md, the GPU check), which failed the engine's
pool threads; a compiled CUDA step now runs on one thread of its own, given that state first
(fusion.forward.graph_thread). This probe says what the machine's torch does, in seconds.

    python benchmarks/cuda_graph_threads.py [--out FILE]

Prints one JSON object (and writes it to FILE): torch's version, and "ok" or the error for the compiling
thread, for a new thread replaying its graph, and for a new thread given the trees' state first
(`fusion.forward.graph_thread.prepare_graph_trees`, what a compiled CUDA decode step's own thread does) that
compiles and replays a graph of its own. Exit 0 when it ran (whatever it found), 3 without a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

import torch

from fusion.forward.graph_thread import prepare_graph_trees


def replay(step, x: torch.Tensor, want: torch.Tensor) -> str:
    """Three calls of `step`, each checked against the eager result: "ok", or the error."""
    try:
        for _ in range(3):
            got = step(x)
            torch.cuda.synchronize()
            if not torch.allclose(got, want, rtol=1e-3, atol=1e-3):
                return "wrong result"
        return "ok"
    except Exception as err:  # noqa: BLE001  the finding itself
        return f"{type(err).__name__}: {err}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_graph_threads: no CUDA device visible to torch", file=sys.stderr)
        return 3

    def body(x: torch.Tensor) -> torch.Tensor:  # (64, 64)
        return (x @ x).relu() + 1.0

    step = torch.compile(body, mode="reduce-overhead")
    x = torch.randn(64, 64, device="cuda")
    want = body(x)
    found = {"torch": torch.__version__, "compiling_thread": replay(step, x, want)}

    def other() -> None:
        found["other_thread"] = replay(step, x, want)

    def prepared() -> None:  # what a compiled CUDA decode step's own thread does first (fusion.forward.graph_thread)
        prepare_graph_trees()
        found["prepared_thread"] = replay(fresh_step, x, want)

    fresh_step = torch.compile(lambda x: body(x) * 2.0 - body(x), mode="reduce-overhead")  # a graph of its own
    for target, name in ((other, "probe"), (prepared, "probe-prepared")):
        thread = threading.Thread(target=target, name=name)
        thread.start()
        thread.join()
    text = json.dumps(found)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
