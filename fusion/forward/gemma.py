"""A single-token decode forward for Gemma 2 and Gemma 3 text models (`gemma2`, `gemma3_text`), in the
manner of `fusion.forward.llama.FastDecoder`: one plain function over the model's own weights
(query/key/value and gate/up projections fused into one matrix product each) reading the session's cache
layers directly.

Gemma differs from Llama in ways transformers' eager forward pays for per step: a scaled embedding,
four RMS norms per layer (weights stored as `w`, applied as `1 + w`), a tanh-GELU MLP, Gemma 3's RMS
norms over each query and key head (Gemma 2 soft-caps the attention scores and the logits instead, with
tanh), and interleaved layer types (Gemma 3: each with its own rotary table): sliding-window layers
(transformers' `DynamicSlidingWindowLayer`, which keeps exactly the window's last columns) and
full-attention ones (`GrowingLayer`). For a new id every cached column of its layer is visible, so
attention needs no mask and no per-step mask building:

    ids (B,) ─ embed·√hidden ─┬─ for each layer: norm → qkv → q/k head norms → rotary (the layer type's table)
                              │   → attention over the layer's cached columns and the new key → o-proj → norm
                              │   + residual → norm → gate_up → gelu_tanh·mul → down → norm + residual
                              └─ final norm → lm_head → (B, V) float32, and the new keys/values (layers, B, H_kv, D)

It serves one history at a time: one session's step, or B candidate ids after one history (the
cross-tokenizer lookahead); sessions with sliding-window layers are never batched together. Eager only:
the layers' widths differ (a window against the whole history), so there is no one masked shape to
compile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicSlidingWindowLayer

from fusion.forward.ops import attend, decoder_shape, frozen, fuse_projections, project, projection_lists, rotary, rotate, weight_of
from fusion.forward.kv_cache import GrowingLayer

MODEL_TYPES = ("gemma2", "gemma3_text")


def unsupported_reason(model) -> str | None:
    """Why `GemmaDecoder` cannot run this Gemma model (None: it can)."""
    config = model.config
    if getattr(config, "model_type", None) not in MODEL_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r} (this path: {', '.join(MODEL_TYPES)})"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if getattr(config, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        return f"activation {config.hidden_activation!r} (only gelu_pytorch_tanh)"
    if getattr(config, "attention_bias", False):
        return "attention biases"
    rotary = model.model.rotary_emb
    kinds = rotary.rope_type.values() if isinstance(rotary.rope_type, dict) else [rotary.rope_type]
    if any("dynamic" in str(kind) for kind in kinds):
        return "a dynamic rotary embedding (its table changes with the length)"
    if set(config.layer_types) - {"sliding_attention", "full_attention"}:
        return f"layer types {sorted(set(config.layer_types))}"
    return None


class GemmaDecoder(nn.Module):
    """The decode step of one Gemma 2 or Gemma 3 text model over its own weights (see the module docstring)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = decoder_shape(model, unsupported_reason(model))
        config = model.config
        self.scale = float(config.query_pre_attn_scalar) ** -0.5
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.attention_softcap = getattr(config, "attn_logit_softcapping", None)
        inner = model.model
        self.embed = frozen(inner.embed_tokens.weight)  # (V_in, hidden)
        embedding = inner.embed_tokens
        self.embed_scale = float(getattr(embedding, "scalar_embed_scale", None) or embedding.embed_scale)
        self.lm_head = weight_of(model.get_output_embeddings())  # (V, hidden), or quantized
        rotary = inner.rotary_emb
        # Per layer type: the model's own rotary table (any scaling already folded in) and its factor (Gemma
        # 2: one table for every layer).
        self.layer_types = list(config.layer_types)
        for kind in sorted(set(self.layer_types)):
            table = getattr(rotary, f"{kind}_inv_freq", None)
            table = rotary.inv_freq if table is None else table
            self.register_buffer(f"{kind}_inv_freq", table.detach().float().clone(), persistent=False)
        self.rope_scaling = {kind: float(getattr(rotary, f"{kind}_attention_scaling",
                                                 getattr(rotary, "attention_scaling", 1.0)))
                             for kind in set(self.layer_types)}
        # Gemma's norms multiply by (1 + w): kept as that sum, in float32, as transformers computes it.
        self.final_norm = nn.Parameter(1.0 + inner.norm.weight.detach().float(), requires_grad=False)
        self.qkv, self.o_proj, self.gate_up, self.down = projection_lists(inner.layers[0], 4)
        self.norms = nn.ParameterList()  # per layer (4, hidden): input, post-attention, pre-MLP, post-MLP
        self.head_norms = nn.ParameterList()  # per layer (2, head_dim): query, key (Gemma 3)
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, _ = fuse_projections([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up, _ = fuse_projections([mlp.gate_proj, mlp.up_proj])
            self.qkv.append(frozen(qkv))
            self.o_proj.append(weight_of(attn.o_proj))
            self.gate_up.append(frozen(gate_up))
            self.down.append(weight_of(mlp.down_proj))
            norms = [layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                     layer.post_feedforward_layernorm]
            self.norms.append(nn.Parameter(1.0 + torch.stack([n.weight.detach().float() for n in norms]),
                                           requires_grad=False))  # (4, hidden)
            if hasattr(attn, "q_norm"):
                self.head_norms.append(nn.Parameter(
                    1.0 + torch.stack([attn.q_norm.weight.detach().float(), attn.k_norm.weight.detach().float()]),
                    requires_grad=False))  # (2, head_dim)
        self.intermediate = inner.layers[0].mlp.down_proj.in_features

    @staticmethod
    def can_read(layers: list) -> bool:
        """Whether a session's cache layers are ones this step reads: filled sliding-window and
        full-attention layers."""
        return bool(layers) and all(
            (type(layer) is GrowingLayer and layer.keys is not None)
            or (type(layer) is DynamicSlidingWindowLayer and layer.is_initialized)
            for layer in layers)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Gemma's RMS norm: in float32, times (1 + w), back to the input's dtype."""
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * weight).to(x.dtype)

    def forward(
        self,
        ids: torch.Tensor,  # (B,) the new id of each row
        positions: torch.Tensor,  # (B,) its position (ids before it)
        keys: list[torch.Tensor],  # per layer (B or 1, H_kv, n_layer, D): every column is visible
        values: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The logits (B, V) float32 and the new keys and values (layers, B, H_kv, D), for the caller to
        append. Keys and values of one row serve every row (B candidate ids after one history)."""
        batch = ids.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(ids, self.embed) * torch.tensor(self.embed_scale, dtype=self.embed.dtype)  # (B, hidden)
        tables = {kind: rotary(positions, getattr(self, f"{kind}_inv_freq"), factor, x.dtype)
                  for kind, factor in self.rope_scaling.items()}  # (B, 1, D) cos and sin per layer type
        new_keys, new_values = [], []
        for layer, kind in enumerate(self.layer_types):
            norms = self.norms[layer]
            h = self._norm(x, norms[0])
            q, k, v = project(h, self.qkv[layer]).split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
            q, k = q.view(batch, heads, dim), k.view(batch, kv_heads, dim)
            if len(self.head_norms):
                q, k = self._norm(q, self.head_norms[layer][0]), self._norm(k, self.head_norms[layer][1])
            q, k = rotate(q, *tables[kind]), rotate(k, *tables[kind])
            v = v.view(batch, kv_heads, dim)
            new_keys.append(k)
            new_values.append(v)
            attn = attend(q, k, v, keys[layer], values[layer], self.scale,
                          softcap=self.attention_softcap)  # (B, H·D), every column visible
            x = x + self._norm(project(attn, self.o_proj[layer]), norms[1])
            gate, up = project(self._norm(x, norms[2]), self.gate_up[layer]).split(self.intermediate, dim=-1)
            x = x + self._norm(project(F.gelu(gate, approximate="tanh") * up, self.down[layer]), norms[3])
        logits = project(self._norm(x, self.final_norm), self.lm_head).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits, torch.stack(new_keys), torch.stack(new_values)
