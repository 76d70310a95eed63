"""llama.cpp beside the project in `fusion bench --suites weights`, run in a process of its own.

Why a process of its own: llama.cpp and torch each bring an OpenMP runtime, and each runtime's threads
spin for a while after their work before they sleep. In one process on a 2-core host, alternating rounds
then time each engine against the other's spinning threads: each engine's decode step measured three to
four times its time alone. A user runs llama.cpp as a program of its own; so does
the benchmark. The worker (`python -m fusion.tools.llamacpp_engine GGUF THREADS`) imports llama.cpp's
binding and never torch, and answers one JSON line a request on its standard output.

`LlamaCpp` is the engine itself (in the worker); `LlamaCppProcess` is the benchmark's handle on a worker,
with the same methods.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class LlamaCpp:
    """llama.cpp on one GGUF file with `threads` threads, through llama-cpp-python (built from source with the
    machine's flags, ~40 minutes on 2 cores) or, where that is not installed, llama-cpp-py-sync (prebuilt CPU
    wheels of a recent llama.cpp, installed in seconds). ImportError if neither is."""

    def __init__(self, gguf: Path, threads: int) -> None:
        self.threads = threads
        self.path = Path(gguf)
        try:
            from llama_cpp import Llama, __version__, llama_print_system_info

            self.binding = f"llama-cpp-python {__version__}"
            self.system_info = llama_print_system_info().decode()
            self.llm = Llama(str(gguf), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
            self._sync = None
        except ImportError:
            import llama_cpp_py_sync

            self.binding = (f"llama-cpp-py-sync {llama_cpp_py_sync.__version__} "
                            f"(llama.cpp {llama_cpp_py_sync.__llama_cpp_commit__[:10]})")
            self.system_info = llama_cpp_py_sync.Llama.print_system_info()
            self._sync = llama_cpp_py_sync.Llama(str(gguf), n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                                                 verbose=False)
            lib = self._sync._lib  # its default sampler draws; a greedy chain, as the fused stream's
            greedy = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
            lib.llama_sampler_chain_add(greedy, lib.llama_sampler_init_greedy())
            lib.llama_sampler_free(self._sync._sampler)
            self._sync._sampler = greedy

    def probe_id(self) -> int:
        """An id every vocabulary has (the model's beginning-of-sequence, else 0): what the worker evaluates
        before it answers (`_serve`)."""
        if self._sync is None:
            bos = self.llm.token_bos()
            return bos if bos is not None and bos >= 0 else 0
        return 0

    @property
    def keeps_prompts(self) -> bool:
        """Whether `tokens_per_s` can keep the prompt the call before read (`prompt_kept`): llama-cpp-python's
        `generate` matches its context's prefix; llama-cpp-py-sync's calls here start from an empty context."""
        return self._sync is None

    def _start(self, prompt: list[int]) -> int:
        """A fresh context that has read `prompt`: the number of ids it holds."""
        if self._sync is None:
            self.llm.reset()
            self.llm.eval(prompt)
            return len(prompt)
        self._sync._clear_context_state()
        return self._sync._eval_tokens(prompt, 0)

    def _next(self, token: int, held: int) -> int:
        if self._sync is None:
            self.llm.eval([token])
            return held + 1
        return self._sync._eval_tokens([token], held)

    def step_times(self, prompt: list[int], steps: int) -> list[float]:
        """Seconds of each single-token decode after the prompt (the same token fed each step: a decode
        forward costs the same whatever the token)."""
        held = self._start(prompt)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            held = self._next(prompt[-1], held)
            times.append(time.perf_counter() - start)
        return times

    def tokens_per_s(self, prompt: list[int], tokens: int, prompt_kept: bool = False) -> float:
        """Greedy generation of `tokens` tokens after the prompt, prompt included in the time, as the
        fused stream's rate includes its prefill. `prompt_kept` (llama-cpp-python only): the context keeps
        what it shares with the prompt from the call before (`generate`'s prefix match), as the fused
        stream's experts keep prefixes (`fusion.experts.prefix_pool`)."""
        start = time.perf_counter()
        produced = 0
        if self._sync is None:
            if not prompt_kept:  # else `generate` keeps the longest prefix its context shares with the prompt
                self.llm.reset()
            for _ in self.llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                produced += 1
                if produced == tokens:
                    break
        else:
            held = self._start(prompt)
            while True:
                token = self._sync._sample_token()
                produced += 1
                if produced == tokens:
                    break
                held = self._next(token, held)
        return produced / (time.perf_counter() - start)


class LlamaCppProcess:
    """A `LlamaCpp` in a worker process of its own (module docstring), with its methods. ImportError if the
    worker finds no binding; RuntimeError if it fails otherwise."""

    def __init__(self, gguf: Path, threads: int) -> None:
        self.path, self.threads = Path(gguf), threads
        # The worker's messages go to a file, not a pipe: a pipe nobody reads until the end would stall a worker
        # that writes more than its buffer holds.
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives as long as the handle; close() ends it)
        self._worker = subprocess.Popen([sys.executable, "-m", __name__, str(gguf), str(threads)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        try:
            hello = self._answer()
        except BaseException:
            self.close()
            raise
        self.binding, self.system_info = hello["binding"], hello["system_info"]
        self.keeps_prompts = hello["keeps_prompts"]

    def _answer(self) -> dict:
        line = self._worker.stdout.readline()
        if not line:
            code = self._worker.wait(timeout=30)
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            self._log.seek(0)
            raise RuntimeError(f"the llama.cpp worker ended ({how}): {self._log.read().strip()[-2000:]}")
        answer = json.loads(line)
        if "error" in answer:
            raise (ImportError if answer.get("kind") == "ImportError" else RuntimeError)(answer["error"])
        return answer

    def _ask(self, **request) -> dict:
        self._worker.stdin.write(json.dumps(request) + "\n")
        self._worker.stdin.flush()
        return self._answer()

    def step_times(self, prompt: list[int], steps: int) -> list[float]:
        return self._ask(op="step_times", prompt=prompt, steps=steps)["times"]

    def tokens_per_s(self, prompt: list[int], tokens: int, prompt_kept: bool = False) -> float:
        return self._ask(op="tokens_per_s", prompt=prompt, tokens=tokens, prompt_kept=prompt_kept)["tokens_per_s"]

    def close(self) -> None:
        if self._worker.poll() is None:
            try:
                self._worker.stdin.close()  # the worker's loop ends at the end of its input
                self._worker.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._worker.kill()
                self._worker.wait()
        self._worker.stdout.close()
        self._log.close()


def _serve(gguf: str, threads: int) -> None:
    """The worker's loop: one JSON request a line on standard input, one JSON answer a line on standard output;
    the first answer describes the engine (or the error that kept it from loading)."""
    out = sys.stdout
    sys.stdout = sys.stderr  # the bindings' own prints must not interleave with the answers

    def send(answer: dict) -> None:
        out.write(json.dumps(answer) + "\n")
        out.flush()

    try:
        engine = LlamaCpp(Path(gguf), threads)
        # A build that cannot evaluate fails here, before any timing: a few ids at once (a prompt's batched
        # products, where a native build's AMX kernels crashed on one host) and one decode step.
        engine.step_times([engine.probe_id()] * 8, 1)
    except (ImportError, OSError, RuntimeError, ValueError) as err:  # reaches the benchmark as an answer
        send({"error": f"{type(err).__name__}: {err}", "kind": "ImportError" if isinstance(err, ImportError) else "other"})
        return
    send({"binding": engine.binding, "system_info": engine.system_info, "keeps_prompts": engine.keeps_prompts})
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "step_times":
            send({"times": engine.step_times(request["prompt"], request["steps"])})
        elif request["op"] == "tokens_per_s":
            send({"tokens_per_s": engine.tokens_per_s(request["prompt"], request["tokens"], request["prompt_kept"])})
        else:
            send({"error": f"unknown request {request['op']!r}"})


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
