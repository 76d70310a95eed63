"""The fused decode engine. It knows only token ids; text, chat templates and stop strings live at the edge.

One decode step for a batch of requests:
  1. step every expert on its sessions; each returns next-token logits `(B, V_e)`. In-process CPU
     experts run one after another on the process's compute thread (each forward already uses every
     core); remote experts overlap on a thread each, GPU experts on a CUDA stream each
  2. align vocabularies → `(E, B, V)`; refuse rows with NaN/+inf logits
  3. fuse with each request's rule and weights → `(B, V)`
  4. sample (mask/bias → penalties → temperature → top-k/top-p/min-p) → `(B,)` token ids
  5. append the token to every expert's history; stop on EOS, stop ids or max_tokens
Requests join and leave a `DecodeBatch` between steps (continuous batching). A joining request's
prompt is prefilled in chunks of at most `limits.prefill_chunk_tokens` per step, shared by all joining
requests, so running streams never wait for more than one chunk; the step that completes a prompt
also samples its first token. Each expert computes only what its cache lacks.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Sequence

import torch

from fusion.engine.admission import Admission
from fusion.compute import run_on_compute_thread
from fusion.config import Limits
from fusion.engine.batch import DecodeBatch
from fusion.engine.types import (FUSED_NOT_FINITE, ErrorEvent, GenerationRequest, Row, StepJob, StepTimings,
                                 TokenEvent, new_request_id, nonfinite, nonfinite_rows)
from fusion.errors import (
    ExpertOutputError,
    ExpertUnavailableError,
    FusionError,
    InvalidArgumentError,
)
from fusion.experts.expert import Expert, LocalExpert, StepRequest
from fusion.experts.isolation import isolate_failures
from fusion.fuse.rules import FusionRule, teacher_forced_context
from fusion.fuse.sampler import token_bias_row
from fusion.engine.vocab import VocabAlignment

logger = logging.getLogger(__name__)

# Positions one scoring job computes on the compute thread: bounds both the wait it adds to a decode
# step and its (E, SCORE_CHUNK, V) float32 logits (3 x 128 x 49,152 x 4 B = 75 MB).
SCORE_CHUNK = 128


class FusionEngine:
    """Runs N experts in lockstep over shared generated ids. Thread-compatible: one DecodeBatch per thread."""

    def __init__(self, experts: Sequence[Expert], limits: Limits | None = None, device: str = "cpu", *,
                 mixed_tokenizers: bool = False) -> None:
        """`mixed_tokenizers`: the experts' tokenizers differ and the caller fuses them over text
        (`fusion.crosstok.step`); this engine then must not decode token ids (they mean different strings)."""
        if not experts:
            raise InvalidArgumentError("experts: at least one expert is required")
        self.experts = list(experts)
        self.names = [e.info.name for e in self.experts]
        self.mixed_tokenizers = mixed_tokenizers
        self.alignment = VocabAlignment.from_infos([e.info for e in self.experts], mixed=mixed_tokenizers)
        self.vocab_size = self.alignment.width
        self.limits = limits or Limits()
        self.device = torch.device(device)
        self.admission = Admission(self.limits, self.vocab_size, tuple(self.names),
                                   tuple(e.info.max_positions for e in self.experts), cross=mixed_tokenizers)
        self.eos_token_ids = frozenset(itertools.chain.from_iterable(e.info.eos_token_ids for e in self.experts))
        self._pool = ThreadPoolExecutor(max_workers=len(self.experts), thread_name_prefix="expert")
        self._streams = [
            torch.cuda.Stream(device=e.info.device) if e.info.device.startswith("cuda") else None
            for e in self.experts
        ]
        # In-process CPU experts all compute on the one compute thread (fusion.compute), so they run one
        # after another from the stepping thread; remote and GPU experts overlap on the pool.
        in_process = [getattr(e, "shared_base", e) for e in self.experts]
        self._inline = [isinstance(e, LocalExpert) and e.device.type == "cpu" for e in in_process]
        # Experts that are adapters over one loaded base (fusion.experts.shared_base): their rows of a step run as
        # one batch. Index -> the indices of its group (itself alone when it shares no base).
        by_base: dict[int, list[int]] = {}
        for index, expert in enumerate(self.experts):
            by_base.setdefault(id(in_process[index]), []).append(index)
        self._group_of = {i: members for members in by_base.values() for i in members}
        self.last_timings = StepTimings()
        # Called with each decode step's timings, on the stepping thread (metrics are one observer).
        self.step_observers: list[Callable[[StepTimings], None]] = []

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- admission ----------------------------------------------------------------------------
    def admit(self, request: GenerationRequest) -> GenerationRequest:
        """Check a request given as ids (`Admission.generation`) and build the per-request state every
        step reads. The service checks its requests itself, field by field, and calls `prepare`."""
        self.admission.generation(request)
        return self.prepare(request)

    def prepare(self, request: GenerationRequest) -> GenerationRequest:
        """Build the per-request state every step reads (bias row, stop ids), once."""
        request.token_bias = token_bias_row(request.sampling, self.vocab_size, self.device)
        request.stop_ids = frozenset(request.sampling.stop_token_ids) | (
            frozenset() if request.sampling.ignore_eos else self.eos_token_ids)
        return request

    # -- generation ---------------------------------------------------------------------------
    def new_batch(self) -> DecodeBatch:
        return DecodeBatch(self)

    def generate(self, request: GenerationRequest) -> Iterator[TokenEvent]:
        """Stream one request's tokens (validated here: this bypasses the service's admission). Closing
        the generator early releases its sessions."""
        self.admit(request)
        batch = self.new_batch()
        batch.add(request)
        try:
            while batch.active:
                for event in batch.step():
                    if isinstance(event, ErrorEvent):
                        raise event.error
                    yield event
        finally:
            batch.cancel_all()

    def generate_many(self, requests: Sequence[GenerationRequest]) -> dict[str, list[TokenEvent]]:
        """Run requests as one batch to completion; returns each request's events by id."""
        batch = self.new_batch()
        results: dict[str, list[TokenEvent]] = {}
        for request in requests:
            self.admit(request)
            batch.add(request)
            results[request.request_id] = []
        try:
            while batch.active:
                for event in batch.step():
                    if isinstance(event, ErrorEvent):
                        raise event.error
                    results[event.request_id].append(event)
        finally:
            batch.cancel_all()
        return results

    # -- scoring ------------------------------------------------------------------------------
    def score(
        self,
        prompt_ids: list[list[int]],
        continuation_ids: list[int],
        rule: FusionRule,
        weights: list[float],
        run_chunk: Callable[[Callable[[int], list[float]]], list[float]] | None = None,
        alternatives: list[tuple[list[int], list[float], int]] | None = None,
        top: int = 0,
    ) -> list[float]:
        """Fused log-probability of each continuation id after each expert's prompt (teacher forcing).

        Runs in chunks, each its own job: `run_chunk(job)` runs `job(positions)`, which scores the next
        `positions` ids at most (default: `SCORE_CHUNK` each on the compute thread; a service's
        scheduler runs each chunk between decode steps, sized to what a step can wait for), so running
        streams' decode steps interleave with a long score and memory holds one chunk's (E, chunk, V)
        logits; each expert's session cache carries the prefix between chunks. With `top` > 0, the `top`
        likeliest ids of each position, their log-probabilities and the scored id's rank (1: likeliest)
        are appended to `alternatives`."""
        self.admission.weights(rule, weights)
        self.admission.continuation_ids(continuation_ids)
        self.admission.prompt_ids(prompt_ids, rule, weights, len(continuation_ids), "continuation")
        uses = [rule.uses_expert(e, weights) for e in range(len(self.experts))]
        session = f"score-{new_request_id()}"
        context = teacher_forced_context(prompt_ids[0], continuation_ids, self.device)  # (n, K)
        logprobs: list[float] = []

        def next_chunk(positions: int) -> list[float]:
            start = len(logprobs)
            end = min(len(continuation_ids), start + max(1, min(positions, SCORE_CHUNK)))
            return self._score_chunk(session, prompt_ids, continuation_ids, start, end, uses, rule, weights,
                                     context[start:end], alternatives if top else None, top)

        run = run_chunk or (lambda job: run_on_compute_thread(job, SCORE_CHUNK))
        try:
            while len(logprobs) < len(continuation_ids):
                logprobs += run(next_chunk)
        finally:
            for expert in self.experts:
                expert.release([session])
        return logprobs

    def _score_chunk(self, session, prompt_ids, continuation_ids, start, end, uses, rule, weights, context,
                     alternatives: list | None = None, top: int = 0) -> list[float]:
        """Log-probabilities of continuation ids [start, end): each expert scores them after its prompt
        and the continuation before `start` (cached in `session` by the previous chunk)."""
        n = end - start

        def run(index: int) -> torch.Tensor:
            if not uses[index]:
                return torch.zeros(n, self.vocab_size, device=self.device)
            history = list(prompt_ids[index]) + list(continuation_ids[:end])
            return self.experts[index].score(session, history, n)  # (n, V_e)

        logits = self.alignment.stack([t.to(self.device) for t in self._map_experts(run)]).float()  # (E, n, V)
        self.check_finite(logits, rows=None, consulted=torch.tensor(uses, device=self.device))
        w = torch.tensor(weights, dtype=torch.float32, device=self.device)[:, None].expand(-1, n)  # (E, n)
        fused = rule.fuse(logits, w, context).logits  # (n, V)
        if nonfinite_rows(fused):
            raise ExpertOutputError(FUSED_NOT_FINITE)
        log_probs = torch.log_softmax(fused.float(), dim=-1)  # (n, V)
        ids = torch.tensor(continuation_ids[start:end], device=self.device)
        chosen = log_probs.gather(-1, ids[:, None])  # (n, 1)
        if alternatives is not None:
            best = log_probs.topk(min(top, log_probs.shape[-1]), dim=-1)  # (n, top)
            ranks = (log_probs > chosen).sum(-1) + 1  # (n,): 1 = the likeliest
            alternatives.extend(zip(best.indices.tolist(), best.values.tolist(), ranks.tolist()))
        return chosen[:, 0].tolist()

    def continuation_logits(
        self, prompt_ids: list[list[int]], continuation_ids: list[int], uses: Sequence[bool] | None = None
    ) -> torch.Tensor:
        """Every expert's logits predicting each continuation id, teacher forced: (E, n, V).
        Experts not in `uses` are not run (zeros)."""
        return run_on_compute_thread(self._continuation_logits, prompt_ids, continuation_ids, uses)

    def _continuation_logits(self, prompt_ids, continuation_ids, uses) -> torch.Tensor:
        self.admission.continuation_ids(continuation_ids)
        n = len(continuation_ids)
        session = f"score-{new_request_id()}"
        uses = list(uses) if uses is not None else [True] * len(self.experts)

        def run(index: int) -> torch.Tensor:
            if not uses[index]:
                return torch.zeros(n, self.vocab_size, device=self.device)
            expert = self.experts[index]
            return expert.score(session, list(prompt_ids[index]) + list(continuation_ids), n)

        try:
            per_expert = self._map_experts(run)
        finally:
            for expert in self.experts:
                expert.release([session])
        logits = self.alignment.stack([t.to(self.device) for t in per_expert]).float()  # (E, n, V)
        self.check_finite(logits, rows=None, consulted=torch.tensor(uses, device=self.device))
        return logits

    def fused_logprobs(
        self, logits: torch.Tensor, continuation_ids: list[int], rule: FusionRule, weights: list[float],
        prefix_ids: Sequence[int],
    ) -> list[float]:
        """Fuse teacher-forced logits (E, n, V) and gather each continuation id's log-probability.
        `prefix_ids` are the ids before the continuation (the first expert's prompt)."""
        return run_on_compute_thread(self._fused_logprobs, logits, continuation_ids, rule, weights, prefix_ids)

    def _fused_logprobs(self, logits, continuation_ids, rule, weights, prefix_ids) -> list[float]:
        log_probs = self.fused_distribution(logits, continuation_ids, rule, weights, prefix_ids)  # (n, V)
        ids = torch.tensor(continuation_ids, device=self.device)
        return log_probs.gather(-1, ids[:, None])[:, 0].tolist()

    def fused_distribution(
        self, logits: torch.Tensor, continuation_ids: Sequence[int], rule: FusionRule, weights: list[float],
        prefix_ids: Sequence[int],
    ) -> torch.Tensor:
        """The fused log-distribution (n, V) at each teacher-forced position of `logits` (E, n, V)."""
        n = logits.shape[1]
        w = torch.tensor(weights, dtype=torch.float32, device=self.device)[:, None].expand(-1, n)  # (E, n)
        context = teacher_forced_context(prefix_ids, continuation_ids, self.device)  # (n, K)
        fused = rule.fuse(logits, w, context).logits  # (n, V)
        return torch.log_softmax(fused.float(), dim=-1)

    # -- internals ----------------------------------------------------------------------------
    def step_experts(self, jobs: list[StepJob]) -> tuple[torch.Tensor, dict[int, Exception]]:
        """Step every expert on the sessions that consult it. (E, B, V) logits (zeros where not consulted
        or failed) and the rows whose expert call failed, by batch row: a failure fails only its rows."""
        timings = self.last_timings
        joint: dict[int, tuple[list[int], torch.Tensor | None, dict[int, Exception], float]] = {}
        joint_lock = threading.Lock()

        def run(index: int) -> tuple[torch.Tensor | None, dict[int, Exception]]:
            row_idx = [b for b, job in enumerate(jobs) if job.histories[index] is not None]
            if not row_idx:
                return None, {}
            if len(self._group_of[index]) > 1:  # the first member to run steps the whole group
                with joint_lock:
                    if index not in joint:
                        joint.update(self._step_group(self._group_of[index], jobs))
                    kept, out, errors, seconds = joint.pop(index)
                timings.per_expert_s[self.names[index]] = seconds
            else:
                start = time.perf_counter()
                kept, out, errors = self._step_isolating(index, jobs, row_idx)  # out: (len(kept), V_e)
                timings.per_expert_s[self.names[index]] = time.perf_counter() - start
            if out is None:
                return None, errors
            if len(kept) == len(jobs):
                return out, errors
            full = torch.zeros(len(jobs), out.shape[-1], dtype=out.dtype, device=out.device)
            full[kept] = out
            return full, errors

        outputs = self._map_experts(run)
        width = self.vocab_size
        failed: dict[int, Exception] = {}
        for _, errors in outputs:
            for b, err in errors.items():
                failed.setdefault(b, err)
        filled = [
            o.to(self.device) if o is not None else torch.zeros(len(jobs), width, device=self.device)
            for o, _ in outputs
        ]
        return self.alignment.stack(filled).float(), failed

    def _step_group(self, members: list[int], jobs: list[StepJob]
                    ) -> dict[int, tuple[list[int], torch.Tensor | None, dict[int, Exception], float]]:
        """One step of experts sharing a base (`members`): their rows in one batch. Per member: the rows
        stepped, their logits, the failed rows' errors and its share of the time. When the joint step
        fails, each member is stepped on its own (`_step_isolating`), so a failure lands only on the rows
        that cause it."""
        parts = [(i, [b for b, job in enumerate(jobs) if job.histories[i] is not None]) for i in members]
        parts = [(i, rows) for i, rows in parts if rows]
        start = time.perf_counter()
        try:
            requests = [(self.experts[i], [StepRequest(jobs[b].session_id, jobs[b].histories[i]) for b in rows])
                        for i, rows in parts]
            outs = self.experts[parts[0][0]].shared_base.step_members(requests)  # per member (b_i, V)
        except Exception as err:
            logger.warning("experts %s failed a joint step (%s); stepping them one by one",
                           [self.names[i] for i, _ in parts], type(err).__name__)
        else:
            share = (time.perf_counter() - start) / len(parts)
            return {i: (rows, out, {}, share) for (i, rows), out in zip(parts, outs)}
        results = {}
        for i, rows in parts:
            begin = time.perf_counter()
            kept, out, errors = self._step_isolating(i, jobs, rows)
            results[i] = (kept, out, errors, time.perf_counter() - begin)
        return results

    def _step_isolating(self, index: int, jobs: list[StepJob], row_idx: list[int]
                        ) -> tuple[list[int], torch.Tensor | None, dict[int, Exception]]:
        """One expert's step on `row_idx`, under the one isolation policy (`fusion.experts.isolation`): when it
        fails, the rows are stepped again in halves so the failure lands only on the rows that cause it.
        An expert lost altogether fails its rows without retries. Returns (rows stepped, their logits
        (len(rows), V_e), the failed rows' errors)."""
        expert, stream = self.experts[index], self._streams[index]

        def step(rows: Sequence[int]) -> torch.Tensor:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                out = expert.step([StepRequest(jobs[b].session_id, jobs[b].histories[index]) for b in rows])
                if stream is not None:
                    stream.synchronize()
            return out  # (len(rows), V_e)

        done, failed = isolate_failures(step, row_idx, fatal=(ExpertUnavailableError,),
                                        what=f"step of expert {self.names[index]!r}")
        errors: dict[int, Exception] = {}
        for position, err in failed.items():
            b = row_idx[position]
            if not isinstance(err, FusionError):
                logger.error("expert %r failed the step of session %s", self.names[index], jobs[b].session_id,
                             exc_info=err)
                err = ExpertOutputError(f"expert {self.names[index]!r} failed this request's step "
                                        f"({type(err).__name__}); the other requests go on")
            errors[b] = err
        kept = [row_idx[position] for positions, _ in done for position in positions]
        return kept, torch.cat([out for _, out in done]) if done else None, errors

    def _map_experts(self, fn):
        """[fn(0), …, fn(E-1)]: overlapped experts go to the pool first, inline ones run meanwhile here."""
        futures = {
            i: self._pool.submit(fn, i) for i in range(len(self.experts)) if not self._inline[i]
        } if len(self.experts) > 1 else {}
        results = [None] * len(self.experts)
        try:
            for i in range(len(self.experts)):
                if i not in futures:
                    results[i] = fn(i)
        finally:
            for i, future in futures.items():
                results[i] = future.result()
        return results

    def check_finite(
        self, logits: torch.Tensor, rows: list[Row] | None, consulted: torch.Tensor | None = None
    ) -> list[tuple[int, str]]:
        """Rows (with the expert's name) whose logits hold NaN, +inf, or no finite value. One host sync.
        `consulted` (E,) bool limits the check to experts that were run."""
        bad = nonfinite(logits)  # (E, B)
        if consulted is not None:
            bad &= consulted[:, None]
        if not bool(bad.any()):
            return []
        problems = [(int(b), self.names[int(e)]) for e, b in bad.nonzero().tolist()]
        if rows is None:
            raise ExpertOutputError(f"expert {problems[0][1]!r} returned non-finite logits (NaN or inf)")
        return problems
