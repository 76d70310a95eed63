"""Conversions between the wire messages and the core's types, shared by servers and clients.

Logits travel as raw bytes with dtype and shape (not `repeated float`, ~20x slower to serialise in
Python). The default wire dtype is the model's own: a bf16 model's logits are bf16 values even
though the expert returns them as float32, so sending them as bf16 is exact and halves the bytes.
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

import torch
from google.protobuf import json_format

from fusion.config import FusionSpec, Limits, SamplingParams, SpecOverrides
from fusion.errors import ExpertOutputError, InvalidArgumentError
from fusion.experts.expert import ExpertInfo
from fusion.frontdoor.service import FusionRequest, ServiceDescription
from fusion.frontdoor.text import Message
from fusion.services.protos import expert_pb2, fusion_pb2

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -- tensors -----------------------------------------------------------------------------------
def wire_dtype(requested: str, model_dtype: str) -> str:
    """The dtype to send: the requested one, else the model's own (exact), else float32."""
    if requested:
        if requested not in WIRE_DTYPES:
            raise InvalidArgumentError(f"dtype: expected one of {sorted(WIRE_DTYPES)}, got {requested!r}")
        return requested
    return model_dtype if model_dtype in WIRE_DTYPES else "float32"


def encode_tensor(tensor: torch.Tensor, dtype: str) -> expert_pb2.Tensor:
    t = tensor.detach().to("cpu", WIRE_DTYPES[dtype]).contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: send its bits
        t = t.view(torch.int16)
    return expert_pb2.Tensor(data=t.numpy().tobytes(), dtype=dtype, shape=list(tensor.shape))


def decode_tensor(message: expert_pb2.Tensor, where: str) -> torch.Tensor:
    """A float32 tensor from the wire; ExpertOutputError (naming `where`) if the bytes do not fit."""
    dtype = WIRE_DTYPES.get(message.dtype)
    shape = tuple(message.shape)
    if dtype is None:
        raise ExpertOutputError(f"{where}: unknown logits dtype {message.dtype!r}")
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if len(message.data) != expected:
        raise ExpertOutputError(f"{where}: {len(message.data)} logits bytes do not fit shape {list(shape)} "
                                f"of {message.dtype}")
    if expected == 0:
        return torch.empty(shape, dtype=torch.float32)
    # bytearray: torch needs a writable buffer; the copy is a memcpy next to the network transfer.
    return torch.frombuffer(bytearray(message.data), dtype=dtype).view(shape).float()


# -- expert info -------------------------------------------------------------------------------
def limits_to_proto(limits: Limits) -> expert_pb2.Limits:
    known = expert_pb2.Limits.DESCRIPTOR.fields_by_name
    return expert_pb2.Limits(**{k: v for k, v in limits.model_dump().items() if k in known})


def info_to_proto(info: ExpertInfo, limits: Limits, active_sessions: int) -> expert_pb2.ExpertInfo:
    return expert_pb2.ExpertInfo(
        name=info.name, model=info.model, vocab_size=info.vocab_size, tokenizer_size=info.tokenizer_size,
        tokenizer_fingerprint=info.tokenizer_fingerprint, eos_token_ids=list(info.eos_token_ids),
        dtype=info.dtype, device=info.device, max_cached_tokens=info.max_cached_tokens,
        max_positions=info.max_positions, limits=limits_to_proto(limits), active_sessions=active_sessions,
    )


def info_from_proto(message: expert_pb2.ExpertInfo) -> ExpertInfo:
    return ExpertInfo(
        name=message.name, model=message.model, vocab_size=message.vocab_size,
        tokenizer_size=message.tokenizer_size, tokenizer_fingerprint=message.tokenizer_fingerprint,
        eos_token_ids=tuple(message.eos_token_ids), dtype=message.dtype, device=message.device,
        max_cached_tokens=message.max_cached_tokens,
        max_positions=message.max_positions if message.HasField("max_positions") else None,
    )


# -- requests: proto → core --------------------------------------------------------------------
def _set_fields(message) -> dict[str, Any]:
    """The fields a client set: scalars with presence, non-empty lists and maps."""
    out: dict[str, Any] = {}
    for field, value in message.ListFields():
        if hasattr(value, "items"):
            out[field.name] = dict(value)
        elif hasattr(value, "__len__") and not isinstance(value, (str, bytes)):
            out[field.name] = list(value)
        else:
            out[field.name] = value
    return out


def sampling_overrides(message: fusion_pb2.SamplingParams) -> dict[str, Any]:
    """Sampling fields the request set, by SamplingParams name (validated later, over the defaults)."""
    out = _set_fields(message)
    if message.HasField("structured"):
        out["structured"] = structured_from_proto(message.structured)
    return out


def structured_from_proto(message: fusion_pb2.StructuredOutput) -> dict[str, Any]:
    kind = message.WhichOneof("kind")
    if kind is None:
        raise InvalidArgumentError("sampling.structured: set one of json_schema, json_object, regex, choice, grammar")
    if kind == "json_schema":
        try:
            schema = json.loads(message.json_schema)
        except ValueError as err:  # JSONDecodeError, or a number past Python's digit limit
            raise InvalidArgumentError(f"sampling.structured.json_schema: not JSON ({err})") from None
        if not isinstance(schema, dict):
            raise InvalidArgumentError("sampling.structured.json_schema: must be a JSON object")
        return {"json_schema": schema}
    if kind == "choice":
        return {"choice": list(message.choice.values)}
    return {kind: getattr(message, kind)}


def structured_to_proto(structured: dict[str, Any]) -> fusion_pb2.StructuredOutput:
    message = fusion_pb2.StructuredOutput()
    if structured.get("json_schema") is not None:
        message.json_schema = json.dumps(structured["json_schema"])
    elif structured.get("json_object"):
        message.json_object = True
    elif structured.get("choice") is not None:
        message.choice.values.extend(structured["choice"])
    else:
        for kind in ("regex", "grammar"):
            if structured.get(kind) is not None:
                setattr(message, kind, structured[kind])
    return message


def _plain_number(value: Any) -> Any:
    """Struct holds every number as a double; give integral ones back as ints (e.g. an expert index)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _plain_number(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_number(v) for v in value]
    return value


def spec_overrides_from_proto(message: fusion_pb2.FusionSpec) -> SpecOverrides:
    """The spec fields a request set; the service layers them over its config (`layer_spec`)."""
    params = _plain_number(json_format.MessageToDict(message.params)) if message.HasField("params") else None
    return SpecOverrides(
        rule=message.rule if message.HasField("rule") else None,
        params=params,
        weights=dict(message.weights) or None,
        profile=message.profile if message.HasField("profile") else None,
    )


def prompt_from_request(request: fusion_pb2.GenerateRequest) -> str | list[Message]:
    if request.prompt and request.messages:
        raise InvalidArgumentError("prompt, messages: give exactly one of them, not both")
    if request.messages:
        return [{"role": m.role, "content": m.content} for m in request.messages]
    return request.prompt


def request_from_proto(request: fusion_pb2.GenerateRequest) -> FusionRequest:
    return FusionRequest(
        prompt=prompt_from_request(request),
        sampling=sampling_overrides(request.sampling),
        spec=spec_overrides_from_proto(request.spec) if request.HasField("spec") else None,
        request_id=request.request_id or None,
        continue_final_message=request.continue_final_message,
    )


def description_to_proto(description: ServiceDescription) -> fusion_pb2.DescribeResponse:
    experts = []
    for expert in description.experts:
        info = info_to_proto(expert.info, description.limits, active_sessions=expert.active_sessions)
        experts.append(fusion_pb2.ExpertDescription(
            info=info, default_weight=expert.default_weight, addresses=expert.addresses,
        ))
    return fusion_pb2.DescribeResponse(
        experts=experts,
        rules=[fusion_pb2.RuleDescription(name=name, params=params) for name, params in description.rules.items()],
        profiles=[fusion_pb2.Profile(name=name, weights=weights) for name, weights in description.profiles.items()],
        default_spec=spec_to_proto(description.default_spec),
        default_sampling=sampling_to_proto(description.default_sampling),
        limits=limits_to_proto(description.limits),
        active_requests=description.active_requests,
    )


# -- requests: core → proto (clients) ----------------------------------------------------------
def sampling_to_proto(sampling: dict[str, Any] | SamplingParams | None) -> fusion_pb2.SamplingParams:
    if sampling is None:
        return fusion_pb2.SamplingParams()
    fields = sampling.model_dump() if isinstance(sampling, SamplingParams) else dict(sampling)
    known = set(fusion_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise InvalidArgumentError(f"sampling: unknown field(s) {unknown}; known: {sorted(known)}")
    fields = {k: v for k, v in fields.items() if v is not None}
    if "structured" in fields:
        structured = fields["structured"]
        fields["structured"] = structured_to_proto(structured if isinstance(structured, dict)
                                                   else structured.model_dump())
    try:
        return fusion_pb2.SamplingParams(**fields)
    except (TypeError, ValueError) as err:
        raise InvalidArgumentError(f"sampling: {err}") from None


def spec_to_proto(spec: FusionSpec | SpecOverrides | None) -> fusion_pb2.FusionSpec | None:
    """A whole spec (every field set) or a request's overrides (only the fields it sets)."""
    if spec is None:
        return None
    message = fusion_pb2.FusionSpec(weights=spec.weights or {})
    if spec.rule is not None:
        message.rule = spec.rule
    if spec.params is not None:
        message.params.SetInParent()  # sent even when empty
        message.params.update(spec.params)
    if spec.profile is not None:
        message.profile = spec.profile
    return message


def generate_request(
    prompt: str | Sequence[Message],
    sampling: dict[str, Any] | SamplingParams | None = None,
    spec: FusionSpec | SpecOverrides | None = None,
    request_id: str = "",
    continue_final_message: bool = False,
) -> fusion_pb2.GenerateRequest:
    request = fusion_pb2.GenerateRequest(sampling=sampling_to_proto(sampling), request_id=request_id,
                                         continue_final_message=continue_final_message)
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.messages.extend(fusion_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    if spec is not None:
        request.spec.CopyFrom(spec_to_proto(spec))
    return request
