"""OpenTelemetry traces, opt-in: one trace per request, carried across gRPC to the experts.

Off unless `configure` is given an OTLP endpoint (`--otlp-traces-endpoint`) or the standard
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT` variables name one; the SDK and
the OTLP exporter are the optional extra `otel` (`pip install 'logit-fusion[otel]'`). Off, every hook
below is one attribute test and nothing is imported.

What a request's trace holds (GenAI semantic conventions where they fit):
- `generate` (SERVER, the coordinator's Generate; parent: the caller's `traceparent`, if sent), with
  the request's sampling parameters, usage and finish reason, and four children timed from what the
  service reports: `admission` (validation and admission), `queue` (waiting for a batch slot),
  `prefill` (from the slot to the first token) and `decode` (the first token to the last);
- `expert.step` (CLIENT) for each Step call to a remote expert. A call that serves one request is
  that request's child; a batched call serving several starts a trace of its own, linked to each;
- on the expert, `Expert/Step` (SERVER), the child of the call that carried its context.

The provider is this module's own, not OpenTelemetry's global one: servers in one process (tests,
`fusion generate` beside a server) share it, and `shutdown` turns tracing off again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from fusion.errors import ConfigError

logger = logging.getLogger(__name__)

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
SYSTEM = "logit-fusion"


class _State:
    tracer: Any = None  # an SDK tracer while tracing is on
    provider: Any = None
    lock = threading.Lock()
    # request id -> its trace, from its admission (before the scheduler can step it) to its end
    requests: dict[str, "RequestTrace"] = {}


def active() -> bool:
    """Whether traces are recorded (the hooks' one test when off)."""
    return _State.tracer is not None


def configure(endpoint: str | None = None, service_name: str = "fusion", *, exporter: Any = None) -> bool:
    """Turn tracing on: spans go in batches to the OTLP/gRPC `endpoint` (`http://host:port` for plain
    text, `https://` or a bare `host:port` for TLS, as OpenTelemetry reads it; its `OTEL_EXPORTER_OTLP_*`
    variables set the rest), else to the endpoint the standard variables name; none, or
    `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`: tracing stays off. `exporter` replaces the
    OTLP one (tests). Returns whether tracing is on. Turned on by the variables alone where the `otel`
    extra is missing, it logs why and stays off (a pod's injected variables must not stop it serving);
    asked for by `endpoint`, it raises ConfigError."""
    from_environment = endpoint is None and exporter is None
    endpoint = endpoint or next((os.environ[v] for v in ENDPOINT_VARIABLES if os.environ.get(v)), None)
    if endpoint is None and exporter is None:
        return False
    if from_environment and (os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true"
                             or os.environ.get("OTEL_TRACES_EXPORTER", "").lower() == "none"):
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError:
        hint = "OpenTelemetry traces need the SDK and the OTLP exporter: pip install 'logit-fusion[otel]'"
        if from_environment:
            logger.warning("%s; tracing stays off (%s is set)", hint, next(v for v in ENDPOINT_VARIABLES
                                                                          if os.environ.get(v)))
            return False
        raise ConfigError(f"--otlp-traces-endpoint: {hint}") from None
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if exporter is None and protocol and protocol != "grpc":
        logger.warning("OTLP protocol %r asked for; traces go over gRPC, the one this service exports", protocol)
    if exporter is None:
        exporter = OTLPSpanExporter(endpoint=endpoint)
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    with _State.lock:
        previous, _State.provider = _State.provider, provider
        _State.tracer = provider.get_tracer(SYSTEM)
    if previous is not None:
        previous.shutdown()
    logger.info("OpenTelemetry traces to %s", endpoint or type(exporter).__name__)
    return True


def flush(timeout_s: float = 30.0) -> bool:
    provider = _State.provider
    return provider.force_flush(int(timeout_s * 1000)) if provider is not None else True


def shutdown() -> None:
    """Send what is buffered and turn tracing off."""
    with _State.lock:
        provider, _State.provider, _State.tracer = _State.provider, None, None
        _State.requests.clear()
    if provider is not None:
        provider.shutdown()


def _now() -> int:
    return time.time_ns()


def _context_from(metadata: Iterable[tuple[str, Any]] | None):
    """The W3C trace context a gRPC call's metadata (or an HTTP request's headers) carries (None: none)."""
    from opentelemetry.propagate import extract

    carrier = {key: value for key, value in (metadata or ()) if isinstance(value, str)}
    return extract(carrier) if "traceparent" in carrier else None


def _inject(span) -> list[tuple[str, str]]:
    from opentelemetry import trace
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier, context=trace.set_span_in_context(span))
    return list(carrier.items())


# -- the coordinator: one request's trace ----------------------------------------------------------
@dataclass
class RequestTrace:
    """One streamed request's span and the moments its children are cut from."""

    span: Any
    received_ns: int
    admitted_ns: int | None = None
    joined_ns: int | None = None
    first_token_ns: int | None = None
    tokens: int = 0
    attributes: dict[str, Any] = field(default_factory=dict)
    request_id: str | None = None  # registered under it from admission until the end


def start_request(name: str, metadata, received_ns: int, sampling: Mapping[str, Any] | None = None, *,
                  http_route: str | None = None) -> RequestTrace | None:
    """The request's SERVER span (None when tracing is off), child of the caller's trace context: the
    gRPC call's metadata, or the HTTP request's headers (`http_route`: its path)."""
    tracer = _State.tracer
    if tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    attributes = {"gen_ai.system": SYSTEM, "gen_ai.operation.name": "chat" if name == "chat" else "text_completion"}
    if http_route is None:
        attributes |= {"rpc.system": "grpc", "rpc.method": name}
    else:
        attributes |= {"http.request.method": "POST", "http.route": http_route}
    for key, value in (sampling or {}).items():
        if value is not None:
            attributes[f"gen_ai.request.{key}"] = value
    span = tracer.start_span(name.lower(), context=_context_from(metadata), kind=SpanKind.SERVER,
                             start_time=received_ns, attributes=attributes)
    return RequestTrace(span, received_ns)


def admitted(trace: RequestTrace | None, request_id: str, prompt_tokens: int) -> None:
    """The request passed admission: from now on the scheduler and the experts' calls find its trace."""
    if trace is None:
        return
    trace.admitted_ns = _now()
    trace.request_id = request_id
    trace.span.set_attribute("fusion.request_id", request_id)
    trace.span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
    with _State.lock:
        _State.requests[request_id] = trace


def joined_batch(request_id: str, tenant: str, waited_s: float) -> None:
    """The scheduler's admission observer: the request took its first batch slot now."""
    trace = _State.requests.get(request_id)  # (registered at admission, before it could be queued)
    if trace is not None:
        trace.joined_ns = _now()


def token(trace: RequestTrace | None) -> None:
    if trace is not None:
        trace.tokens += 1
        if trace.first_token_ns is None:
            trace.first_token_ns = _now()


def end_request(trace: RequestTrace | None, request_id: str | None, finish_reason: str | None,
                error: BaseException | None = None) -> None:
    """The stream ended: its children (from the recorded moments) and the span itself."""
    if trace is None:
        return
    from opentelemetry import trace as otel
    from opentelemetry.trace import Status, StatusCode

    with _State.lock:  # (a request refused after admission registered it ends with no id of the caller's)
        for registered in {request_id, trace.request_id} - {None}:
            _State.requests.pop(registered, None)
    tracer = _State.tracer
    end = _now()
    if tracer is not None:
        parent = otel.set_span_in_context(trace.span)
        # the moments in order (a clock read on another thread may land a little before one read earlier)
        moments, last = [], trace.received_ns
        for moment in (trace.admitted_ns, trace.joined_ns, trace.first_token_ns,
                       end if trace.first_token_ns is not None else None):
            last = None if moment is None or last is None else max(moment, last)
            moments.append(last)
        starts = [trace.received_ns] + moments[:-1]
        for name, start, stop in zip(("admission", "queue", "prefill", "decode"), starts, moments):
            if start is not None and stop is not None:
                tracer.start_span(name, context=parent, start_time=start).end(end_time=stop)
        end = max(end, *(m for m in moments if m is not None)) if any(m is not None for m in moments) else end
    trace.span.set_attribute("gen_ai.usage.output_tokens", trace.tokens)
    if finish_reason:
        trace.span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
    trace.span.add_event("stream end", {"fusion.finish_reason": finish_reason or "", "fusion.tokens": trace.tokens})
    if error is not None:
        trace.span.record_exception(error)
        trace.span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    trace.span.end(end_time=end)


# -- the coordinator's calls to remote experts -----------------------------------------------------
def start_expert_call(expert: str, method: str, session_ids: Sequence[str], address: str):
    """A CLIENT span for one call to an expert replica and the metadata that carries it (None, [] when
    off): the child of the one request it serves, else linked to each."""
    tracer = _State.tracer
    if tracer is None:
        return None, []
    from opentelemetry import trace as otel
    from opentelemetry.trace import Link, SpanKind

    traces = [t for t in (_State.requests.get(s) for s in dict.fromkeys(session_ids)) if t is not None]
    if not traces:  # sessions of untraced requests: no trace of their own
        return None, []
    parent = otel.set_span_in_context(traces[0].span) if len(traces) == 1 else None
    links = [Link(t.span.get_span_context()) for t in traces] if len(traces) > 1 else None
    span = tracer.start_span(f"expert.{method.lower()}", context=parent, kind=SpanKind.CLIENT, links=links,
                             attributes={"rpc.system": "grpc", "rpc.service": "fusion.v1.Expert", "rpc.method": method,
                                         "fusion.expert": expert, "fusion.sessions": len(session_ids),
                                         "server.address": address})
    return span, _inject(span)


def fail(span, error: BaseException) -> None:
    """Mark `span` (None: tracing off) failed with `error`."""
    if span is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))


def end_expert_call(span, call) -> None:
    """End the call's span as its future `call` completes (an error status if it failed)."""
    if span is None:
        return
    try:
        error = call.exception() if call is not None else None
    except Exception as cancelled:  # a cancelled call has no exception to give
        error = cancelled
    if error is not None:
        fail(span, error)
    span.end()


# -- the expert server --------------------------------------------------------------------------
def start_expert_server_span(method: str, metadata, expert: str, sessions: int):
    """The expert replica's SERVER span for one call, the child of the calling span (None when off)."""
    tracer = _State.tracer
    if tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    return tracer.start_span(f"Expert/{method}", context=_context_from(metadata), kind=SpanKind.SERVER,
                             attributes={"rpc.system": "grpc", "rpc.service": "fusion.v1.Expert", "rpc.method": method,
                                         "fusion.expert": expert, "fusion.sessions": sessions})
