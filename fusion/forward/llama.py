"""A single-token decode forward for Llama-family models, written as one plain function of torch operators
over the expert's own KV buffers.

transformers' eager forward runs a decode step as hundreds of small ops, each a Python module call
(30 layers of norms, four projections, rotary, SDPA and a three-projection MLP for SmolLM2-135M).
`FastDecoder` does the same arithmetic with the query/key/value and gate/up projections each one
matrix product (the model's own weights become views of the fused matrices: no second copy) and
attention read straight from the `GrowingLayer` buffers:

    ids (B,) ─ embed ─┬─ for each layer: rmsnorm → qkv → rotary → attention over the cached columns
                      │                   (masked, mask (B, 1, 1, width)) and the new key → o-proj + residual
                      │                   → rmsnorm → gate_up → silu·mul → down + residual
                      └─ final rmsnorm → lm_head → (B, V) float32, and the new keys/values (layers, B, H_kv, D)

`decode_on_layers` then appends the new keys and values to the buffers (`GrowingLayer.update`).

Only steady decoding takes this path: one new id per row, plain (full-attention) cache layers whose
rows end at a common column (a session alone, or an expert's `Cohort`). Prefill, prompt chunks and
every other shape stay on transformers' forward, over the same caches, so prefix reuse, cohort
batching and chunked prefill see no difference. Except where the C step below runs the layers: there a
short forward (the config's `c_step_prompt_ids`), and every forward of a batch-invariant expert
(`batch_invariant`), runs its ids one row each through it (`FastDecoder.prefill`, `prefill_on_layers`), so
that every id is computed as a decode step of it would be.

On a CPU, when every projection is in one of the project's own quantized layouts (`weights: int4 |
int8`, fusion.forward.quantized), an eager step runs its layers as one call into C instead
(fusion.forward.native_step): the same arithmetic in float32, without dispatching dozens of small torch operators a
layer. The embedding, the rotary table, the final norm and the head stay here.

`DecodeStep` runs it eagerly; on CUDA its layers run inside the static-shape step's captured graphs
(fusion.forward.static_step). A step compiled by inductor is retired: on a CPU its cold compile took
minutes and the C step is faster; on CUDA its graph trees bound each graph to the thread that recorded it
(docs/performance.md, "On a GPU").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fusion.forward import native_kernels
from fusion.forward.ops import (attend, decoder_shape, frozen, fuse_projections, project, projection_lists, rotary, rotate,
                               weight_of)
from fusion.forward.gemma import MODEL_TYPES as GEMMA, GemmaDecoder
from fusion.forward.gemma import unsupported_reason as gemma_unsupported_reason
from fusion.forward.kv_cache import GrowingLayer
from fusion.forward.native_step import NativeLayers
from fusion.forward.quantized import QuantizedLinear

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Rotary embeddings whose frequencies are fixed once the model is built (Llama 3.x's `llama3` scaling,
# `linear`, `yarn` with its attention factor): the step uses the model's own `inv_freq` and
# `attention_scaling`. Dynamic NTK and LongRoPE change them with the sequence's length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


# Why Gemma takes no static step.
GEMMA_EAGER_ONLY = ("the static decode step is for Llama-family models: Gemma's layers differ in width "
                     "(sliding windows), so it runs the eager fast step (decode: fast)")


def unsupported_reason(model, *, static: bool = False) -> str | None:
    """Why no fast decode step (the static one, with `static`) can run this model (None: one can; Gemma
    2 and 3 text models take `fusion.forward.gemma.GemmaDecoder`, eager only, Llama-family ones
    `FastDecoder`)."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type in GEMMA:
        return gemma_unsupported_reason(model) or (GEMMA_EAGER_ONLY if static else None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES + GEMMA)})"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope type {rope_type!r} (supported: {', '.join(STATIC_ROPE_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (only silu)"
    qwen = model_type in ("qwen2", "qwen3")  # their configs name a window that applies only when switched on
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) and not qwen:
        return "sliding-window attention"
    if qwen and getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    layers = model.model.layers
    if any(not hasattr(layer, "self_attn") or not hasattr(layer, "mlp") for layer in layers):
        return "a layer without self_attn and mlp"
    if any(getattr(layer.self_attn.o_proj, "bias", None) is not None for layer in layers):
        return "an output projection with a bias"
    if any(hasattr(layer.self_attn, "q_norm") != (model_type == "qwen3") for layer in layers):
        return "query/key norms other than Qwen3's (per head)"
    return None


class FastDecoder(nn.Module):
    """The decode step of one Llama-family model over its own weights (see the module docstring)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = decoder_shape(model, unsupported_reason(model))
        inner = model.model
        self.embed = frozen(inner.embed_tokens.weight)  # (V_in, hidden)
        self.norm = frozen(inner.norm.weight)
        self.lm_head = weight_of(model.get_output_embeddings())  # (V, hidden), or quantized
        rotary = inner.rotary_emb
        self.register_buffer("inv_freq", rotary.inv_freq.detach().float().clone(), persistent=False)
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        # Per layer, as parameters of this module (views of the model's own), or quantized projections
        # (fusion.forward.quantized) whose codes are the model's own:
        self.qkv, self.o_proj, self.gate_up, self.down = projection_lists(inner.layers[0], 4)
        self.qkv_bias = nn.ParameterList()
        self.input_norm, self.post_norm = nn.ParameterList(), nn.ParameterList()
        self.q_norm, self.k_norm = nn.ParameterList(), nn.ParameterList()  # Qwen3's, per head (head_dim,)
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, qkv_bias = fuse_projections([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up, _ = fuse_projections([mlp.gate_proj, mlp.up_proj])
            self.qkv.append(frozen(qkv))
            if qkv_bias is not None:
                self.qkv_bias.append(frozen(qkv_bias))
            self.o_proj.append(weight_of(attn.o_proj))
            self.gate_up.append(frozen(gate_up))
            self.down.append(weight_of(mlp.down_proj))
            self.input_norm.append(frozen(layer.input_layernorm.weight))
            self.post_norm.append(frozen(layer.post_attention_layernorm.weight))
            if hasattr(attn, "q_norm"):
                self.q_norm.append(frozen(attn.q_norm.weight))
                self.k_norm.append(frozen(attn.k_norm.weight))
        self.has_qkv_bias = len(self.qkv_bias) > 0
        self.intermediate = inner.layers[0].mlp.down_proj.in_features
        shape = LayerShape(self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate, self.eps)
        # The same weights again, one module per layer (a plain list: the parameters stay registered once).
        self.has_qk_norm = len(self.q_norm) > 0
        self.blocks = [DecoderLayer(shape, self.qkv[i], self.qkv_bias[i] if self.has_qkv_bias else None,
                                    self.o_proj[i], self.gate_up[i], self.down[i], self.input_norm[i], self.post_norm[i],
                                    *((self.q_norm[i], self.k_norm[i]) if self.has_qk_norm else (None, None)))
                       for i in range(len(self.qkv))]
        self._adapters = None
        # Whether eager steps may run the layers in the project's C step (fusion.forward.native_step), and its
        # table of the layers' weights, built on the first eager step (False: none can run them).
        self.native_layers = True
        self._native: NativeLayers | None | bool = None

    def _native_step(self) -> NativeLayers | None:
        if self._native is None:
            self._native = NativeLayers.of(self) or False
        return self._native or None

    @property
    def adapters(self):
        """A `fusion.experts.multi_lora.MultiAdapter` over these weights (None: none): rows add its deltas."""
        return self._adapters

    @adapters.setter
    def adapters(self, multi) -> None:
        self._adapters = multi
        self._native = None  # the C step's table holds the adapters' stacks: rebuilt on the next step
        for index, block in enumerate(self.blocks):
            block.set_stacks({} if multi is None else {name: multi.fused(index, name) for name in ADAPTED})

    @staticmethod
    def can_read(layers: list) -> bool:
        """Whether a session's (or a cohort's) cache layers are ones this step reads: filled
        full-attention `GrowingLayer`s."""
        return bool(layers) and all(type(layer) is GrowingLayer and layer.keys is not None for layer in layers)

    def forward(
        self,
        ids: torch.Tensor,  # (B,) the new id of each row
        positions: torch.Tensor,  # (B,) its position (cached ids of that row)
        keys: list[torch.Tensor],  # per layer (B or 1, H_kv, width, D), read only: cached columns (and spare ones)
        values: list[torch.Tensor],
        mask: torch.Tensor,  # (B or 1, 1, 1, width) bool: the cached columns each row attends
        adapter_rows: torch.Tensor | None = None,  # (B,) long: each row's adapter (see `adapters`)
        append: bool = False,  # keys/values are B rows of views with room for column `width`: the C step may write
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Returns the logits (B, V) float32 and the new keys and values (layers, B, H_kv, D), which the
        caller writes into the buffers. Keys and values of one row serve every row: B different next
        ids after one shared history (a lookahead), read once, never copied per row. The step reads the
        buffers and writes nothing; masked columns are zeros (GrowingLayer allocates them so), never NaN.
        With `append`, the C step writes the new keys and values into the column after the views instead,
        and returns None for them; the step as torch operators returns them as ever."""
        x = F.embedding(ids, self.embed)  # (B, hidden)
        native = self._native_step() if self.native_layers and NativeLayers.reads(keys, values) else None
        if native is not None:
            cos, sin = rotary(positions, self.inv_freq, self.rope_scaling, torch.float32)
            append = append and keys[0].shape[0] == x.shape[0]
            x, new_keys, new_values = native.run(x, cos, sin, keys, values, mask, adapter_rows, append)  # float32
            if not append:
                new_keys, new_values = new_keys.to(keys[0].dtype), new_values.to(values[0].dtype)
        else:
            cos, sin = rotary(positions, self.inv_freq, self.rope_scaling, x.dtype)  # (B, 1, D) each
            new_keys, new_values = [], []
            for layer, block in enumerate(self.blocks):
                x, k, v = block(x, cos, sin, keys[layer], values[layer], mask, adapter_rows)
                new_keys.append(k)
                new_values.append(v)
            new_keys, new_values = torch.stack(new_keys), torch.stack(new_values)
        logits = self._head(self._final_norm(x) if native is not None else rms_norm(x, self.norm, self.eps),
                            native is not None)
        return logits, new_keys, new_values

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm of the C layers' float32 rows x (B, hidden), in C (`native_kernels.rms_norm`: one call
        where torch dispatches seven operators)."""
        weight = self.__dict__.get("_norm_float32")
        if weight is None or weight.data_ptr() != self.__dict__.get("_norm_source"):
            weight = self.norm.float().contiguous()  # (hidden,): the model's dtype widened, exactly
            self.__dict__["_norm_float32"], self.__dict__["_norm_source"] = weight, self.norm.data_ptr()
        return native_kernels.rms_norm(x, weight, self.eps)

    def _head(self, x: torch.Tensor, native: bool) -> torch.Tensor:
        """The logits (B, V) float32 of normed rows x (B, hidden). After the C step's layers, a quantized head
        multiplies from its codes at any number of rows, as the layers do: a row's logits then never depend on
        how many rows share the step (`FastDecoder.prefill`)."""
        if native and isinstance(self.lm_head, QuantizedLinear):
            return self.lm_head.codes_product(x).float()
        return project(x, self.lm_head).float()

    def prefill(self, ids: torch.Tensor, start: int, keys: list[torch.Tensor], values: list[torch.Tensor],
                adapter_rows: torch.Tensor | None = None, num_logits: int = 1) -> torch.Tensor:
        """The k ids `ids` (k,) of one history after its `start` cached ones, one row each through the C step,
        writing their keys and values into columns [start, start + k) of `keys`/`values` (per layer (1, H_kv,
        start + k, D) views of the history's buffers). Each row attends the columns before its own, packed,
        and its products, norms and rotary run per row: its keys, values and logits are bit for bit those of
        that id stepped alone after the ones before it, whatever the chunking, batch or cache reuse around it.
        Returns the logits of the last `num_logits` rows (n, V) float32. ValueError where the C step cannot
        run these layers."""
        native = self._native_step() if self.native_layers else None
        if native is None or not NativeLayers.reads(keys, values):
            raise ValueError("a prefill row by row needs the C step: int4 or int8 weights in the native kernels' "
                             "layouts on a CPU, over bfloat16 or float32 caches")
        rows, width = ids.shape[0], start + ids.shape[0]
        positions = torch.arange(start, width, device=ids.device)  # (k,)
        cos, sin = rotary(positions, self.inv_freq, self.rope_scaling, torch.float32)
        mask = torch.arange(width, device=ids.device)[None, :] < positions[:, None]  # (k, width)
        x, _, _ = native.run(F.embedding(ids, self.embed), cos, sin, keys, values, mask.view(rows, 1, 1, width),
                             adapter_rows, append=True, columns=positions)
        return self._head(self._final_norm(x[-num_logits:]), True)


# The fused projections an adapter may add to, as `MultiAdapter.fused` names them.
ADAPTED = ("qkv", "o", "gate_up", "down")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMS norm: normalised in float32, rounded to x's dtype, then scaled."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@dataclass(frozen=True)
class LayerShape:
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float


class DecoderLayer(nn.Module):
    """One decoder layer of `FastDecoder`'s step, over the decoder's own weights (registered here too, not
    copied) and, once adapters are installed, their stacks."""

    def __init__(self, shape: LayerShape, qkv, qkv_bias, o_proj, gate_up, down, input_norm, post_norm,
                 q_norm=None, k_norm=None) -> None:
        super().__init__()
        self.shape = shape
        self.qkv, self.qkv_bias, self.o_proj, self.gate_up, self.down = qkv, qkv_bias, o_proj, gate_up, down
        self.input_norm, self.post_norm = input_norm, post_norm
        self.q_norm, self.k_norm = q_norm, k_norm  # (D,) each, or None
        self.stacks = nn.ModuleDict()

    def set_stacks(self, stacks: dict) -> None:
        """The adapters' stacks of this layer's fused projections (missing or None: not adapted)."""
        self.stacks = nn.ModuleDict({name: stack for name, stack in stacks.items() if stack is not None})

    def _adapted(self, y: torch.Tensor, x: torch.Tensor, name: str, rows: torch.Tensor | None) -> torch.Tensor:
        """y (the base projection of x) plus the rows' adapter deltas for fused projection `name`."""
        if rows is None or name not in self.stacks:
            return y
        return y + self.stacks[name](x, rows)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor, adapter_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, hidden) after this layer, and the new key and value (B, H_kv, D) (`FastDecoder.forward`)."""
        batch = x.shape[0]
        heads, kv_heads, dim = self.shape.heads, self.shape.kv_heads, self.shape.head_dim
        h = rms_norm(x, self.input_norm, self.shape.eps)
        qkv = self._adapted(project(h, self.qkv, self.qkv_bias), h, "qkv", adapter_rows)
        q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)  # (B, H·D), (B, H_kv·D) x2
        q, k = q.view(batch, heads, dim), k.view(batch, kv_heads, dim)
        if self.q_norm is not None:  # Qwen3: each head's query and key normed before the rotation
            q, k = rms_norm(q, self.q_norm, self.shape.eps), rms_norm(k, self.k_norm, self.shape.eps)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        v = v.view(batch, kv_heads, dim)
        attn = attend(q, k, v, keys, values, dim ** -0.5, mask)  # (B, H·D)
        x = x + self._adapted(project(attn, self.o_proj), attn, "o", adapter_rows)
        h = rms_norm(x, self.post_norm, self.shape.eps)
        gate, up = self._adapted(project(h, self.gate_up), h, "gate_up", adapter_rows
                                 ).split(self.shape.intermediate, dim=-1)
        act = F.silu(gate) * up
        x = x + self._adapted(project(act, self.down), act, "down", adapter_rows)
        return x, k, v


class DecodeStep:
    """The eager fast step of one model (`FastDecoder`, or Gemma's `GemmaDecoder`)."""

    def __init__(self, model, decoder: FastDecoder | GemmaDecoder | None = None) -> None:
        """`decoder`: an existing decoder of `model` to run."""
        if decoder is None:
            decoder = GemmaDecoder(model) if getattr(model.config, "model_type", None) in GEMMA else FastDecoder(model)
        self.decoder = decoder

    @property
    def reads_whole_layers(self) -> bool:
        """Whether the step attends every column of each layer as given, with no mask (Gemma: one history
        at a time) rather than masked columns of batch buffers (`FastDecoder`)."""
        return isinstance(self.decoder, GemmaDecoder)

    def __call__(self, *inputs, **options):
        """The decoder's forward: its arguments and results."""
        return self.decoder(*inputs, **options)


def decode_on_layers(step: DecodeStep, layers: list, new_ids: list[int], lengths: list[int],
                     adapter_rows: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step over `GrowingLayer`s whose B rows all end at one column (the frontier); row b
    holds `lengths[b]` ids, right-aligned at it (a step that reads whole layers: one row, any layers it
    reads). Appends each row's new keys and values. `adapter_rows` (B,): each row's adapter, for a step
    over several adapters (`FastDecoder.adapters`). (B, V) float32."""
    if step.reads_whole_layers:
        if len(new_ids) != 1:
            raise ValueError(f"{type(step.decoder).__name__} steps one history at a time, got {len(new_ids)}")
        logits, new_keys, new_values = decode_after_shared_history(step, layers, new_ids, lengths[0], adapter_rows)
        for layer, keys, values in zip(layers, new_keys, new_values):
            layer.update(keys[:, :, None], values[:, :, None])
        return logits
    frontier = layers[0].get_seq_length()
    for layer in layers:
        layer.reserve(frontier + 1)
    width = frontier  # attention reads only the filled columns
    device = layers[0]._key_buffer.device
    batch = len(new_ids)
    columns = torch.arange(width, device=device)  # (width,)
    starts = torch.tensor([frontier - n for n in lengths], device=device)  # (B,)
    mask = (columns[None, :] >= starts[:, None]) & (columns[None, :] < frontier)  # (B, width)
    logits, new_keys, new_values = step(
        torch.tensor(new_ids, device=device),
        torch.tensor(lengths, device=device),
        [layer._key_buffer[:, :, :width] for layer in layers],
        [layer._value_buffer[:, :, :width] for layer in layers],
        mask.view(batch, 1, 1, width),
        *(() if adapter_rows is None else (adapter_rows,)),
        append=True,
    )  # (B, V), (layers, B, H_kv, D) x2, or None x2 where the step wrote them after the filled columns
    if new_keys is None:
        for layer in layers:
            layer.filled(frontier + 1)
        return logits
    for layer, keys, values in zip(layers, new_keys, new_values):
        layer.update(keys[:, :, None], values[:, :, None])
    return logits


def prefill_on_layers(step: DecodeStep, layers: list, new_ids: list[int], adapter_rows: torch.Tensor | None = None,
                      num_logits: int = 1) -> torch.Tensor:
    """Append `new_ids` to one history's `GrowingLayer`s (one row; empty, or filled with the ids before)
    through `FastDecoder.prefill`: each id's keys, values and logits as a decode step of it would make them.
    (num_logits, V) float32: the logits after each of the last `num_logits` ids."""
    decoder = step.decoder
    start = layers[0].get_seq_length()
    width = start + len(new_ids)
    like = torch.empty(1, decoder.num_kv_heads, 0, decoder.head_dim, dtype=decoder.embed.dtype,
                       device=decoder.embed.device)
    for layer in layers:
        layer.reserve(width, like)
    logits = decoder.prefill(torch.tensor(new_ids, device=decoder.embed.device), start,
                             [layer._key_buffer[:, :, :width] for layer in layers],
                             [layer._value_buffer[:, :, :width] for layer in layers], adapter_rows, num_logits)
    for layer in layers:
        layer.filled(width)
    return logits


def decode_after_shared_history(step: DecodeStep, layers: list, new_ids: list[int], position: int,
                                adapter_rows: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """B different next ids after the one history of `position` ids that one-row cache layers hold (ones
    `step.decoder.can_read`), each a row of one step reading those layers' columns unexpanded. Appends
    nothing: returns the logits (B, V) float32 and each row's new keys and values (layers, B, H_kv, D),
    for the caller to append the one it keeps."""
    device = layers[0].keys.device
    ids, positions = torch.tensor(new_ids, device=device), torch.full((len(new_ids),), position, device=device)
    if step.reads_whole_layers:
        if adapter_rows is not None:
            raise ValueError(f"{type(step.decoder).__name__} steps run no adapters")
        return step(ids, positions, [layer.keys for layer in layers], [layer.values for layer in layers])
    width = layers[0].get_seq_length()
    mask = torch.ones(1, 1, 1, width, dtype=torch.bool, device=device)  # every filled column
    return step(
        ids,
        positions,
        [layer._key_buffer[:, :, :width] for layer in layers],
        [layer._value_buffer[:, :, :width] for layer in layers],
        mask,
        *(() if adapter_rows is None else (adapter_rows,)),
    )
