"""The streams an admitted request is read through: `RequestStream` (experts of one tokenizer, from
the continuous-batching scheduler) and `CrossRequestStream` (experts of different tokenizers, one fused
text piece per step on the compute thread). Both turn engine events into `TextEvent`s (text deltas held
back at a pending stop string or character, the finish reason, usage) and settle the request's token
reservation on its tenant's quota when it ends, however it ends."""

from __future__ import annotations

import asyncio
import codecs
import math
import threading
import weakref
from typing import AsyncIterator, Iterator

from fusion.compute import run_on_compute_thread
from fusion.crosstok.step import CrossTokenizerFusion
from fusion.crosstok.decode import TextPiece, decode
from fusion.engine.types import ExpertAttribution, GenerationRequest, TokenEvent
from fusion.engine.scheduler import RequestHandle
from fusion.frontdoor.types import TextEvent, Usage
from fusion.engine.tenancy import Reservation, Tenant
from fusion.frontdoor.text import StopMatcher, TextStream


class Settlement:
    """A request's token reservation and what it has used so far; settled once, when it ends."""

    def __init__(self, reservation: Reservation | None, prompt_tokens: int) -> None:
        self.reservation, self.used = reservation, prompt_tokens
        self._lock = threading.Lock()

    @classmethod
    def reserve(cls, tenant: Tenant, tokens: int, used: int) -> Settlement:
        """`tokens` held on the tenant's quota (none without one), `used` counted so far."""
        return cls(tenant.quota.reserve(tokens) if tenant.quota else None, used)

    def close(self) -> None:
        with self._lock:
            reservation, self.reservation = self.reservation, None
        if reservation is not None:
            reservation.settle(self.used)


class _AdmittedRequest:
    """What every stream of an admitted request reports about it."""

    request: GenerationRequest
    settlement: Settlement

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids[0])

    def cancel(self) -> None:
        raise NotImplementedError

    def _to_text(self, item) -> TextEvent:
        """One engine event (or text piece) as the text it makes visible."""
        raise NotImplementedError

    def _items(self) -> Iterator:
        raise NotImplementedError

    def _items_async(self) -> AsyncIterator:
        raise NotImplementedError

    async def _close_async(self) -> None:
        self.cancel()

    def __iter__(self) -> Iterator[TextEvent]:
        try:
            for item in self._items():
                event = self._to_text(item)
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            self.cancel()

    async def __aiter__(self) -> AsyncIterator[TextEvent]:
        try:
            async for item in self._items_async():
                event = self._to_text(item)
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            await self._close_async()


class RequestStream(_AdmittedRequest):
    """One admitted request's `TextEvent`s, read with `for` or `async for`. Leaving the loop early
    (or `cancel`) stops the request and frees its sessions on every expert."""

    def __init__(self, request: GenerationRequest, handle: RequestHandle, text: TextStream,
                 settlement: Settlement) -> None:
        self.request = request
        self._handle = handle
        self._text = text
        self.settlement = settlement
        self._events: AsyncIterator[TokenEvent] | None = None  # the handle's async stream, once read with `async for`
        # A stream dropped without being read (or read halfway) must not decode on to max_tokens.
        weakref.finalize(self, _end, handle, settlement)

    def cancel(self) -> None:
        _end(self._handle, self.settlement)

    def _to_text(self, event: TokenEvent) -> TextEvent:
        self.settlement.used = self.prompt_tokens + event.index + 1
        delta = self._text.push(event.token_id)
        reason = "stop" if self._text.stopped else event.finish_reason
        if reason is None:
            return TextEvent(event, delta)
        return TextEvent(event, delta + self._text.flush(), reason, Usage(self.prompt_tokens, event.index + 1))

    def _items(self) -> Iterator[TokenEvent]:
        return iter(self._handle)

    def _items_async(self) -> AsyncIterator[TokenEvent]:
        self._events = self._handle.stream()
        return self._events

    async def _close_async(self) -> None:
        if self._events is not None:
            await self._events.aclose()  # cancels the request
        self.settlement.close()


def _end(handle: RequestHandle, settlement: Settlement) -> None:
    handle.cancel()
    settlement.close()


class CrossRequestStream(_AdmittedRequest):
    """A request of experts with different tokenizers: `TextEvent`s, one per fused text piece, each
    step run on the compute thread. `event.token.token_id` is -1 (pieces are text, not ids of one
    vocabulary); logprob and attribution are the piece's."""

    def __init__(self, cross: CrossTokenizerFusion, names: list[str], request: GenerationRequest,
                 hold_back_prompt: bool, settlement: Settlement) -> None:
        self.request = request
        self.settlement = settlement
        self._names = names
        self._pieces = decode(cross, request.prompt_ids, request.sampling, request.rule, request.weights,
                              hold_back_prompt=hold_back_prompt)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = StopMatcher(list(request.sampling.stop))
        self._text = ""  # the generated text so far (decoded), up to any stop string
        self._emitted = 0
        self._done = False

    def cancel(self) -> None:
        self._done = True  # a piece being computed meanwhile is the last one
        try:
            self._pieces.close()
        except ValueError:  # the generator is mid-step on the compute thread: it stops at `_done`
            pass
        finally:
            self.settlement.close()

    def _to_text(self, piece: TextPiece) -> TextEvent:
        self.settlement.used = self.prompt_tokens + piece.index + 1
        self._text += self._decoder.decode(piece.piece, final=piece.finish_reason is not None)
        reason = piece.finish_reason
        safe, stopped = self._stops.cut(self._text, self._emitted)
        if stopped:
            reason = "stop"
        elif reason is not None:  # the last piece: nothing is held back any more
            safe = len(self._text)
        visible = self._text[:max(self._emitted, safe)]
        delta, self._emitted = visible[self._emitted:], len(visible)
        attribution = [ExpertAttribution(name, weight, math.exp(lp) if lp is not None else None)
                       for name, weight, lp in zip(self._names, piece.weights, piece.expert_logprobs)]
        token = TokenEvent(self.request_id, piece.index, -1, piece.logprob, [], attribution, reason)
        usage = Usage(self.prompt_tokens, piece.index + 1) if reason is not None else None
        return TextEvent(token, delta, reason, usage)

    def _next(self) -> TextPiece | None:
        piece = next(self._pieces, None)
        if self._done:  # cancelled while this piece was computed: free its sessions here, on this thread
            self._pieces.close()
            return None
        return piece

    def _items(self) -> Iterator[TextPiece]:
        while not self._done and (piece := run_on_compute_thread(self._next)) is not None:
            yield piece

    async def _items_async(self) -> AsyncIterator[TextPiece]:
        while not self._done and (piece := await asyncio.to_thread(run_on_compute_thread, self._next)) is not None:
            yield piece
