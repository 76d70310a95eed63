"""Continuous batching over a `fusion.engine.core.FusionEngine`: the requests running together, joining and
leaving between steps, and one step of the pipeline over them (schedule the prefill budget, step the
experts, fuse, sample, emit events). Its per-row sampling state is built when the set of rows changes,
not every step."""

from __future__ import annotations

import logging
import time

import torch

from fusion.compute import run_on_compute_thread
from fusion.engine.types import (FUSED_NOT_FINITE, ErrorEvent, ExpertAttribution, GenerationRequest, Row, StepJob,
                                 StepLogits, StepTimings, TokenEvent, nonfinite_rows)
from fusion.errors import ExpertOutputError
from fusion.fuse.rules import CONTEXT_TOKENS, context_rows
from fusion.fuse.sampler import SamplingMetadata, sample
from fusion.fuse.structured import apply_masks
from fusion.engine.tenancy import VirtualClock

logger = logging.getLogger(__name__)


class DecodeBatch:
    """The set of requests decoding together. `add` and `cancel` between steps; `step` emits one
    token per active request."""

    def __init__(self, engine) -> None:  # a fusion.engine.core.FusionEngine
        self.engine = engine
        self.rows: list[Row] = []
        self._prefill_clock = VirtualClock()  # joining prompts share each step's prefill budget by tenant
        self._metadata: tuple[tuple[str, ...], SamplingMetadata] | None = None  # `_sampling_metadata`'s

    @property
    def active(self) -> int:
        return len(self.rows)

    def add(self, request: GenerationRequest) -> None:
        """Join a request admitted by its caller (`FusionEngine.admit`, done once at admission)."""
        if request.stop_ids is None:  # a caller that validated it itself
            self.engine.prepare(request)
        experts = range(len(self.engine.experts))
        row = Row(request, prefilled=[0] * len(experts),
                  uses=[request.rule.uses_expert(e, request.weights) for e in experts])
        if request.sampling.seed is not None:
            row.generator = torch.Generator(device=self.engine.device).manual_seed(request.sampling.seed)
        params = request.sampling
        if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
            vocab = self.engine.vocab_size
            row.output_counts = torch.zeros(vocab, device=self.engine.device)
            row.seen = torch.zeros(vocab, dtype=torch.bool, device=self.engine.device)
            row.seen[torch.tensor(request.prompt_ids[0], device=self.engine.device)] = True
        self.rows.append(row)

    def cancel(self, request_id: str) -> bool:
        for i, row in enumerate(self.rows):
            if row.request.request_id == request_id:
                self._finish(i)
                return True
        return False

    def detach(self, request_id: str) -> Row | None:
        """Take a request out of the batch without freeing its sessions (preemption): its experts keep
        its cache, so `attach` later resumes it where it stopped, recomputing only what was evicted."""
        for i, row in enumerate(self.rows):
            if row.request.request_id == request_id:
                return self.rows.pop(i)
        return None

    def attach(self, row: Row) -> None:
        """Resume a detached request."""
        self.rows.append(row)

    def cancel_all(self) -> None:
        while self.rows:
            self._finish(len(self.rows) - 1)

    def _finish(self, index: int) -> None:
        self.release(self.rows.pop(index).request.request_id)

    def release(self, request_id: str) -> None:
        """Free a request's sessions on every expert (it has left the batch)."""
        for expert in self.engine.experts:
            try:
                expert.release([request_id])
            except Exception:  # a dead remote replica has nothing left to free
                logger.warning("could not release session %s on %s", request_id, expert.info.name)

    def _schedule(self) -> tuple[list[Row], list[tuple[Row, list[int]]]]:
        """This step's work: rows that sample (running ones, and joining ones whose rest of prompt fits
        in the prefill budget), and joining rows that compute one more prompt chunk, with the prompt
        length each expert reaches."""
        engine = self.engine
        budget = engine.limits.prefill_chunk_tokens
        ready = [row for row in self.rows if row.prefilled is None]
        joining = [row for row in self.rows if row.prefilled is not None]
        chunks: list[tuple[Row, list[int]]] = []
        clock = self._prefill_clock
        clock.activate(row.request.tenant.id for row in joining)
        # The tenant given the least prefill per unit of weight goes first; a tenant's own prompts in order.
        for row in sorted(joining, key=lambda r: clock.key(r.request.tenant.id)):
            prompts = row.request.prompt_ids
            remaining = max((len(p) - done for p, done, used in zip(prompts, row.prefilled, row.uses) if used),
                            default=0)
            tenant = row.request.tenant
            if remaining <= budget:
                budget -= remaining
                ready.append(row)
                clock.charge(tenant.id, remaining, tenant.weight)
            elif budget > 0:
                chunks.append((row, [min(len(p), done + budget) for p, done in zip(prompts, row.prefilled)]))
                clock.charge(tenant.id, budget, tenant.weight)
                budget = 0
        return ready, chunks

    def fused_logits(self) -> StepLogits:
        """Steps 1-3 of the pipeline for every row that samples this step: expert forwards, alignment,
        fusion (joining rows may only compute a prompt chunk). Rows whose experts failed are cancelled
        and reported in `errors`."""
        engine = self.engine
        rows, chunks = self._schedule()
        jobs = [
            StepJob(r.request.request_id, [p + r.generated if used else None
                                           for p, used in zip(r.request.prompt_ids, r.uses)])
            for r in rows
        ] + [
            StepJob(r.request.request_id, [p[:end] if used and end > done else None
                                           for p, end, done, used in zip(r.request.prompt_ids, ends, r.prefilled,
                                                                         r.uses)])
            for r, ends in chunks
        ]
        start = time.perf_counter()
        try:
            logits, failed = engine.step_experts(jobs)
        except Exception as err:  # a bug, not an expert's failure: every row shares the failed step
            logger.exception("decode step failed")
            errors = [ErrorEvent(r.request.request_id, err) for r in self.rows]
            self.cancel_all()
            return StepLogits([], None, None, None, errors)
        logits = logits[:, : len(rows)]  # (E, B, V); prompt chunks' logits unused
        fuse_start = time.perf_counter()
        engine.last_timings.experts_s = fuse_start - start
        step_errors = [ErrorEvent(jobs[b].session_id, err) for b, err in sorted(failed.items())]
        if step_errors:  # only the rows whose expert call failed leave; the others go on
            gone = {ev.request_id for ev in step_errors}
            for request_id in gone:
                self.cancel(request_id)
            chunks = [(r, ends) for r, ends in chunks if r.request.request_id not in gone]
            keep = [b for b, r in enumerate(rows) if r.request.request_id not in gone]
            rows = [rows[b] for b in keep]
            logits = logits[:, keep]
        for row, ends in chunks:
            row.prefilled = ends
        for row in rows:
            row.prefilled = None
        errors: list[ErrorEvent] = step_errors
        problems = engine.check_finite(logits, rows)
        for b, name in problems:
            request_id = rows[b].request.request_id
            if not any(ev.request_id == request_id for ev in errors):
                errors.append(ErrorEvent(request_id, ExpertOutputError(
                    f"expert {name!r} returned non-finite logits (NaN or inf)")))
        if errors:
            failed = {ev.request_id for ev in errors}
            keep = [b for b, r in enumerate(rows) if r.request.request_id not in failed]
            for request_id in failed:
                self.cancel(request_id)
            rows = [rows[b] for b in keep]
            logits = logits[:, keep]
        if not rows:
            return StepLogits([], None, None, None, errors)
        # on the compute thread's team (fusion.compute): at 16 rows, fusion and sampling take about a third
        # less time on two threads than on one
        fused, weights, normalizers = self._fuse(rows, logits)  # (B, V), (E, B), (E, B) or None
        engine.last_timings.fuse_s = time.perf_counter() - fuse_start
        return StepLogits(rows, logits, fused, weights, errors, normalizers)

    def step(self) -> list[TokenEvent | ErrorEvent]:
        """One token for every active row (steps 1-5); finished rows leave the batch. Runs on the
        process's compute thread (fusion.compute)."""
        return run_on_compute_thread(self._step)

    def _step(self) -> list[TokenEvent | ErrorEvent]:
        if not self.rows:
            return []
        engine = self.engine
        engine.last_timings = timings = StepTimings()  # fresh: experts not stepped leave no entry
        start = time.perf_counter()
        events = self.emit_tokens(self.fused_logits())
        timings.step_s = time.perf_counter() - start
        if timings.per_expert_s:
            for observer in engine.step_observers:
                observer(timings)
        return events

    def emit_tokens(self, step: StepLogits) -> list[TokenEvent | ErrorEvent]:
        """Steps 4-5 for the rows of `step` (from `fused_logits`): sample, attribute, finish rows."""
        engine = self.engine
        events: list[TokenEvent | ErrorEvent] = list(step.errors)
        if not step.rows:
            return events
        start = time.perf_counter()
        rows = step.rows
        unusable = nonfinite_rows(step.fused)
        token_ids, logprobs, weights_host, probs_host, top = self._sample(step)
        engine.last_timings.fuse_sample_s = engine.last_timings.fuse_s + time.perf_counter() - start

        finished = []
        for b, row in enumerate(rows):
            if b in unusable:  # finite experts, yet the rule's arithmetic overflowed: end it, never sample NaN
                events.append(ErrorEvent(row.request.request_id, ExpertOutputError(FUSED_NOT_FINITE)))
                finished.append(row.request.request_id)
                continue
            token = token_ids[b]
            row.generated.append(token)
            grammar_done = row.request.grammar is not None and row.request.grammar.advance(token)
            if row.output_counts is not None:
                row.output_counts[token] += 1
                row.seen[token] = True
            params = row.request.sampling
            reason = None
            if token in row.request.stop_ids or grammar_done:
                reason = "stop"
            elif len(row.generated) >= params.max_tokens:
                reason = "length"
            attribution = [
                ExpertAttribution(
                    name,
                    weights_host[b][e],
                    probs_host[b][e] if row.uses[e] else None,
                )
                for e, name in enumerate(engine.names)
            ]
            n_top = params.logprobs
            events.append(TokenEvent(
                request_id=row.request.request_id,
                index=len(row.generated) - 1,
                token_id=token,
                logprob=logprobs[b],
                top_logprobs=list(zip(top[b][0][:n_top], top[b][1][:n_top])) if top and n_top else [],
                attribution=attribution,
                finish_reason=reason,
            ))
            if reason is not None:
                finished.append(row.request.request_id)
        for request_id in finished:
            self.cancel(request_id)
        return events

    def _sample(self, step: StepLogits) -> tuple[list[int], list[float], list, list, list | None]:
        """Sample each row of `step` and attribute the token, as host lists: token ids (B,), their
        log-probabilities (B,), each row's expert weights (B, E) and each expert's own probability of
        the token (B, E), and the top log-probabilities (per row: ids, log-probs) when any row asks."""
        engine = self.engine
        rows, logits, fused, weights = step.rows, step.logits, step.fused, step.weights
        md = self._sampling_metadata(rows)
        counts = seen = None
        if not md.no_penalties:
            zeros = torch.zeros(engine.vocab_size, device=engine.device)
            counts = torch.stack([r.output_counts if r.output_counts is not None else zeros for r in rows])
            seen = torch.stack([r.seen if r.seen is not None else zeros.bool() for r in rows])
        apply_masks(fused, [(b, r.request.grammar) for b, r in enumerate(rows) if r.request.grammar is not None])
        for b, row in enumerate(rows):
            if row.request.first_token_mask is not None and not row.generated:  # token healing's first token
                fused[b].masked_fill_(~row.request.first_token_mask, float("-inf"))
        out = sample(fused, md, counts, seen)

        # Attribution: each expert's own probability of the chosen token.
        chosen = out.token_ids[None, :, None].expand(logits.shape[0], -1, 1)  # (E, B, 1)
        normalizers = step.log_normalizers if step.log_normalizers is not None else torch.logsumexp(logits, dim=-1)
        expert_probs = (logits.gather(-1, chosen)[..., 0] - normalizers).exp()  # (E, B)
        top = list(zip(out.top_ids.tolist(), out.top_logprobs.tolist())) if out.top_ids is not None else None
        return out.token_ids.tolist(), out.logprobs.tolist(), weights.T.tolist(), expert_probs.T.tolist(), top

    def _sampling_metadata(self, rows: list[Row]) -> SamplingMetadata:
        """The rows' sampling state as tensors, built when the rows that sample together change (a
        request joins, leaves or finishes its prompt) and reused step after step while they stay, as
        vLLM's InputBatch keeps it: steady decoding builds nothing per step. Nothing in it changes
        while a request runs (its generator advances in place)."""
        key = tuple(r.request.request_id for r in rows)
        if self._metadata is None or self._metadata[0] != key:
            engine = self.engine
            metadata = SamplingMetadata.build(
                [r.request.sampling for r in rows],
                engine.vocab_size,
                {b: r.generator for b, r in enumerate(rows) if r.generator is not None},
                engine.device,
                biases=[r.request.token_bias for r in rows],
            )
            self._metadata = (key, metadata)
        return self._metadata[1]

    def _fuse(self, rows: list[Row], logits: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Apply each row's rule; rows sharing a rule object are fused together. (B, V), (E, B), and the
        experts' log-normalizers (E, B) where every rule computed them (else None)."""
        device = self.engine.device
        weights = torch.tensor([r.request.weights for r in rows], dtype=torch.float32, device=device).T  # (E, B)
        histories = [r.request.prompt_ids[0][-CONTEXT_TOKENS:] + r.generated[-CONTEXT_TOKENS:] for r in rows]
        context = context_rows(histories, device)  # (B, K)
        groups: dict[int, list[int]] = {}
        for b, row in enumerate(rows):
            groups.setdefault(id(row.request.rule), []).append(b)
        if len(groups) == 1:
            result = rows[0].request.rule.fuse(logits, weights, context)
            return result.logits, result.weights, result.log_normalizers
        fused = torch.empty(logits.shape[1:], device=device)
        used_weights = torch.empty_like(weights)
        normalizers: torch.Tensor | None = torch.empty_like(weights)
        for indices in groups.values():
            idx = torch.tensor(indices, device=device)
            result = rows[indices[0]].request.rule.fuse(logits[:, idx], weights[:, idx], context[idx])
            fused[idx] = result.logits
            used_weights[:, idx] = result.weights
            if normalizers is not None and result.log_normalizers is not None:
                normalizers[:, idx] = result.log_normalizers
            else:
                normalizers = None
        return fused, used_weights, normalizers
