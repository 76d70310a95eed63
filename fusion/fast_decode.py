"""A single-token decode forward for Llama-family models, written as one plain function over the
expert's own KV buffers, so that `torch.compile` can turn it into a few fused kernels.

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
batching and chunked prefill see no difference.

`DecodeStep` modes: "off" runs the function eagerly (already fewer ops than transformers');
"inductor" compiles it with dynamic shapes (one compilation serves every batch size and cache length;
inductor's on-disk cache makes a second start cheap); "cudagraphs" adds `mode="reduce-overhead"` on
CUDA. The expert config's `decode` field picks one (fusion.expert).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

COMPILE_MODES = ("off", "inductor", "cudagraphs")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def unsupported_reason(model) -> str | None:
    """Why `FastDecoder` cannot run this model (None: it can)."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"rope type {rope.get('rope_type')!r} (only the default rotary embedding)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (only silu)"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) \
            and model_type != "qwen2":
        return "sliding-window attention"
    if model_type == "qwen2" and getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    layers = model.model.layers
    if any(not hasattr(layer, "self_attn") or not hasattr(layer, "mlp") for layer in layers):
        return "a layer without self_attn and mlp"
    if any(getattr(layer.self_attn.o_proj, "bias", None) is not None for layer in layers):
        return "an output projection with a bias"
    if any(hasattr(layer.self_attn, name) for layer in layers for name in ("q_norm", "k_norm")):
        return "query/key norms"
    return None


def _fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several projections of the same input; each module's weight becomes a
    view of its rows of the fused one, so the model keeps working and memory holds one copy."""
    weight = nn.Parameter(torch.cat([lin.weight.detach() for lin in linears]), requires_grad=False)
    biases = [lin.bias for lin in linears]
    bias = (nn.Parameter(torch.cat([b.detach() for b in biases]), requires_grad=False)
            if all(b is not None for b in biases) else None)
    if any(b is not None for b in biases) and bias is None:
        raise ValueError("projections with and without bias cannot be fused")
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight.detach()[start:start + rows], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias.detach()[start:start + rows], requires_grad=False)
        start += rows
    return weight, bias


class FastDecoder(nn.Module):
    """The decode step of one Llama-family model over its own weights (see the module docstring)."""

    def __init__(self, model) -> None:
        super().__init__()
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the fast decode path does not support this model: {reason}")
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = float(config.rms_norm_eps)
        inner = model.model
        as_param = lambda t: t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)
        self.embed = as_param(inner.embed_tokens.weight)  # (V_in, hidden)
        self.norm = as_param(inner.norm.weight)
        self.lm_head = as_param(model.get_output_embeddings().weight)  # (V, hidden)
        rotary = inner.rotary_emb
        self.register_buffer("inv_freq", rotary.inv_freq.detach().float().clone(), persistent=False)
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        # Per layer, as parameters of this module (views of the model's own):
        self.qkv, self.qkv_bias, self.o_proj = nn.ParameterList(), nn.ParameterList(), nn.ParameterList()
        self.gate_up, self.down = nn.ParameterList(), nn.ParameterList()
        self.input_norm, self.post_norm = nn.ParameterList(), nn.ParameterList()
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, qkv_bias = _fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up, _ = _fuse_linears([mlp.gate_proj, mlp.up_proj])
            self.qkv.append(as_param(qkv))
            if qkv_bias is not None:
                self.qkv_bias.append(as_param(qkv_bias))
            self.o_proj.append(as_param(attn.o_proj.weight))
            self.gate_up.append(as_param(gate_up))
            self.down.append(as_param(mlp.down_proj.weight))
            self.input_norm.append(as_param(layer.input_layernorm.weight))
            self.post_norm.append(as_param(layer.post_attention_layernorm.weight))
        self.has_qkv_bias = len(self.qkv_bias) > 0
        self.intermediate = self.down[0].shape[1]

    def _rmsnorm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x32.to(dtype)

    def forward(
        self,
        ids: torch.Tensor,  # (B,) the new id of each row
        positions: torch.Tensor,  # (B,) its position (cached ids of that row)
        keys: list[torch.Tensor],  # per layer (B or 1, H_kv, width, D), read only: cached columns (and spare ones)
        values: list[torch.Tensor],
        mask: torch.Tensor,  # (B or 1, 1, 1, width) bool: the cached columns each row attends
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns the logits (B, V) float32 and the new keys and values (layers, B, H_kv, D), which the
        caller writes into the buffers. Keys and values of one row serve every row: B different next
        ids after one shared history (a lookahead), read once, never copied per row. The step reads the buffers and writes nothing: a compiled graph
        then has no mutated inputs (which CUDA graphs refuse). A compiled step is given the buffers'
        whole capacity, masked, so shapes change only when a buffer grows (by half its size) and it is
        not recompiled as the cache fills; unfilled columns are zeros (GrowingLayer allocates them so),
        never NaN."""
        batch = ids.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        group = heads // kv_heads
        x = F.embedding(ids, self.embed)  # (B, hidden)
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # (B, D/2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (B, D)
        cos = (angles.cos() * self.rope_scaling).to(x.dtype)[:, None, :]  # (B, 1, D)
        sin = (angles.sin() * self.rope_scaling).to(x.dtype)[:, None, :]
        half = dim // 2
        scale = dim ** -0.5
        new_keys, new_values = [], []
        for layer in range(len(self.qkv)):
            h = self._rmsnorm(x, self.input_norm[layer])
            qkv = F.linear(h, self.qkv[layer], self.qkv_bias[layer] if self.has_qkv_bias else None)
            q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)  # (B, H·D), (B, H_kv·D) x2
            q = q.view(batch, heads, dim)
            k = k.view(batch, kv_heads, dim)
            v = v.view(batch, kv_heads, dim)
            q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
            k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
            new_keys.append(k)
            new_values.append(v)
            # Grouped-query attention without repeating keys (each group's queries share one kv head),
            # as plain products: at one query per row, CPU SDPA's flash kernel cost ~2 ms a call.
            q = q.view(batch, kv_heads, group, dim)
            cached = _rows_times(q, keys[layer].transpose(-1, -2))  # (B, H_kv, group, width)
            own = (q * k[:, :, None, :]).sum(-1, keepdim=True)  # (B, H_kv, group, 1): the new column
            scores = torch.cat((cached.float().masked_fill(~mask, float("-inf")), own.float()), dim=-1) * scale
            probs = torch.softmax(scores, dim=-1).to(x.dtype)
            attn = _rows_times(probs[..., :-1], values[layer]) + probs[..., -1:] * v[:, :, None, :]  # (B, H_kv, group, D)
            x = x + F.linear(attn.reshape(batch, heads * dim), self.o_proj[layer])
            h = self._rmsnorm(x, self.post_norm[layer])
            gate, up = F.linear(h, self.gate_up[layer]).split(self.intermediate, dim=-1)
            x = x + F.linear(F.silu(gate) * up, self.down[layer])
        logits = F.linear(self._rmsnorm(x, self.norm), self.lm_head).float()
        return logits, torch.stack(new_keys), torch.stack(new_values)


def _rows_times(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (B, H, G, K) @ b (B or 1, H, K, N) -> (B, H, G, N). When b has one row shared by all B rows, the
    rows join the group axis, so b is read as it is instead of being expanded into B copies."""
    rows, heads, group, _ = a.shape
    if b.shape[0] == rows:
        return torch.matmul(a, b)
    out = torch.matmul(a.transpose(0, 1).reshape(1, heads, rows * group, a.shape[-1]), b)  # (1, H, B·G, N)
    return out.view(heads, rows, group, -1).transpose(0, 1)


def configure_compile_cache(cache_dir: str | Path) -> None:
    """Keep inductor's and its code cache on disk under `cache_dir`, so a second start of the same
    model reuses the compiled kernels. Called once at the edge (the service's start), before the first
    compilation."""
    path = Path(cache_dir).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(path))
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    try:
        inductor_config.autotune_local_cache = True
    except AttributeError:  # older inductor
        pass


class DecodeStep:
    """`FastDecoder` run eagerly or compiled, with the time its first call (the compilation) took."""

    def __init__(self, model, mode: str = "off", decoder: FastDecoder | None = None) -> None:
        """`decoder`: an existing `FastDecoder` of `model` to run (another mode of the same weights)."""
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}")
        self.mode = mode
        self.decoder = decoder if decoder is not None else FastDecoder(model)
        if mode == "off":
            self._run = self.decoder
        else:
            compile_mode = "reduce-overhead" if mode == "cudagraphs" else None
            # Not inductor's `freezing` (weights prepacked as constants): side by side in one process
            # (SmolLM2-135M, bf16, 2 loaded cores) it ran 0.56x transformers' eager time against 0.46x
            # without, kept a second copy of the weights, and its graphs came back from the on-disk
            # cache in 38-41 s against 8.5 s.
            self._run = torch.compile(self.decoder, dynamic=True, mode=compile_mode)
        self.first_call_s: float | None = None

    def __call__(self, ids, positions, keys, values, mask):
        """`FastDecoder.forward`'s arguments and results."""
        start = time.perf_counter() if self.first_call_s is None else None
        if self.mode == "cudagraphs":
            # A replay overwrites the previous replay's outputs: each call is a step of its own, and its
            # outputs are copied out before the next (one expert may run two decode groups in a step).
            torch.compiler.cudagraph_mark_step_begin()
            out = tuple(t.clone() for t in self._run(ids, positions, keys, values, mask))
        else:
            out = self._run(ids, positions, keys, values, mask)
        if start is not None:
            self.first_call_s = time.perf_counter() - start
            if self.mode != "off":
                logger.info("compiled the decode step (%s) in %.1f s", self.mode, self.first_call_s)
        return out


def decode_on_layers(step: DecodeStep, layers: list, new_ids: list[int], lengths: list[int]) -> torch.Tensor:
    """One decode step over `GrowingLayer`s whose B rows all end at one column (the frontier); row b
    holds `lengths[b]` ids, right-aligned at it. Appends each row's new keys and values. (B, V) float32."""
    frontier = layers[0].get_seq_length()
    for layer in layers:
        layer.reserve(frontier + 1)
    # Eagerly, attention reads only the filled columns; compiled, the whole capacity (masked), so that
    # shapes change only when the buffers grow.
    width = frontier if step.mode == "off" else layers[0].capacity
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
    )  # (B, V), (layers, B, H_kv, D) x2
    for layer, keys, values in zip(layers, new_keys, new_values):
        layer.update(keys[:, :, None], values[:, :, None])
    return logits


def decode_after_shared_history(step: DecodeStep, layers: list, new_ids: list[int]
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """B different next ids after the one history that one-row `GrowingLayer`s hold, each a row of one
    step reading those layers' columns unexpanded. Appends nothing: returns the logits (B, V) float32 and
    each row's new keys and values (layers, B, H_kv, D), for the caller to append the one it keeps."""
    frontier = layers[0].get_seq_length()
    width = frontier if step.mode == "off" else layers[0].capacity
    device = layers[0]._key_buffer.device
    mask = (torch.arange(width, device=device) < frontier).view(1, 1, 1, width)
    return step(
        torch.tensor(new_ids, device=device),
        torch.full((len(new_ids),), frontier, device=device),
        [layer._key_buffer[:, :, :width] for layer in layers],
        [layer._value_buffer[:, :, :width] for layer in layers],
        mask,
    )
