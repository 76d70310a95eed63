"""Several LoRA adapters over one base model, applied per batch row in one forward.

Experts that are the same base plus different PEFT adapters (and the base itself) decode as rows of
one batch over one copy of the base weights: on a CPU or a GPU at small batch a decode step is bound
by reading the weights, so three experts' rows cost little more than one. Each row names its
adapter (`AdapterStack.rows`, -1: the plain base); every adapted projection adds

    delta = ((x @ down.T) * own_columns) @ up      x (B, [S,] in), down (K·r, in), up (K·r, out)

where `down` and `up` hold the K adapters' A and B matrices side by side (the scaling folded into
`up`) and `own_columns` (B, K·r) keeps only the row's own adapter's r columns: two plain matrix
products per projection whatever the mix of adapters, no gather, and the same shapes every step.

The adapters load through peft's own path (`PeftConfig.from_pretrained` and `load_peft_weights`: a
local folder or a hub id). Plain LoRA on linear layers only; other PEFT methods (DoRA, biases,
modules to save) load merged instead (`share_base: false`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fusion.errors import AssetError
from fusion.models import resolve_adapter
from fusion.forward.quantized import is_projection

logger = logging.getLogger(__name__)

BASE = -1  # the row index of the plain base (no adapter)


@dataclass(frozen=True)
class LoraPair:
    """One adapted projection of one adapter: A (r, in), B (out, r) and the scaling alpha / r."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


def load_lora(adapter: str, expert_name: str) -> dict[str, LoraPair]:
    """The adapter at `adapter` (folder or hub id) as {module path in the base model: LoraPair}."""
    from peft import PeftConfig
    from peft.utils import load_peft_weights

    adapter = resolve_adapter(adapter)
    try:
        config = PeftConfig.from_pretrained(adapter)
        weights = load_peft_weights(adapter, device="cpu")
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise AssetError(f"expert {expert_name!r}: cannot load adapter {adapter!r}: {first_line}") from None
    unsupported = _unsupported(config)
    if unsupported:
        raise AssetError(f"expert {expert_name!r}: adapter {adapter!r} uses {unsupported}, which runs only merged "
                         "into its own copy of the base (share_base: false)")
    scale = config.lora_alpha / (config.r ** 0.5 if config.use_rslora else config.r)
    pairs: dict[str, LoraPair] = {}
    pattern = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])\.weight$")
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        found = pattern.match(key)
        if found is None:
            raise AssetError(f"expert {expert_name!r}: adapter {adapter!r} holds {key!r}, not a LoRA matrix")
        halves.setdefault(found.group(1), {})[found.group(2)] = tensor
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise AssetError(f"expert {expert_name!r}: adapter {adapter!r} lacks lora_A or lora_B of {module}")
        pairs[module] = LoraPair(pair["A"], pair["B"], scale)
    return pairs


def _unsupported(config) -> str | None:
    if getattr(config, "peft_type", None) is not None and str(config.peft_type).split(".")[-1] != "LORA":
        return f"peft type {config.peft_type}"
    if getattr(config, "use_dora", False):
        return "DoRA"
    if getattr(config, "bias", "none") != "none" or getattr(config, "lora_bias", False):
        return "biases"
    if getattr(config, "modules_to_save", None):
        return "modules_to_save"
    if getattr(config, "rank_pattern", None) or getattr(config, "alpha_pattern", None):
        return "per-module ranks"
    if getattr(config, "fan_in_fan_out", False):
        return "fan_in_fan_out"
    return None


class AdapterRows:
    """The adapter of each row of the forward about to run: (B,) long, shared by every projection; and
    each owner layout's `own_columns` for those rows, computed once per forward however many projections
    share the layout (in a decode step of SmolLM2, 120 stacks share a handful)."""

    def __init__(self, device: torch.device) -> None:
        self.rows = torch.full((1,), BASE, dtype=torch.long, device=device)
        self.any_adapter = False  # whether some row runs an adapter (else every delta is zero: skipped)
        self._own: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # id(owner) -> (owner, rows, own)
        self._owners: dict[tuple[int, ...], torch.Tensor] = {}

    def set(self, rows: list[int]) -> None:
        self.rows = torch.tensor(rows, dtype=torch.long, device=self.rows.device)
        self.any_adapter = any(row != BASE for row in rows)

    def shared_owner(self, owner: torch.Tensor) -> torch.Tensor:
        """One tensor per distinct owner layout, so that stacks of equal layouts share `own_columns`."""
        return self._owners.setdefault(tuple(owner.tolist()), owner)

    def own_columns(self, owner: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """(B, K·r) float32: 1 where column j belongs to row b's adapter, for `rows` (B,)."""
        cached = self._own.get(id(owner))
        if cached is not None and cached[0] is owner and cached[1] is rows:
            return cached[2]
        own = (rows[:, None] == owner[None, :]).float()
        self._own[id(owner)] = (owner, rows, own)
        return own


class AdapterStack(nn.Module):
    """The K adapters of one projection (or of several fused ones), side by side (module docstring)."""

    def __init__(self, down: torch.Tensor, up: torch.Tensor, owner: torch.Tensor,
                 rows: AdapterRows | None = None) -> None:
        super().__init__()
        # float32: at a few rows and rank 8, float32 products on a CPU took about half the time of bf16 ones
        self.register_buffer("down", down.float(), persistent=False)  # (K·r, in): nn.Linear's layout, rows contiguous
        self.register_buffer("up", up.float(), persistent=False)  # (K·r, out), scaled
        owner = owner if rows is None else rows.shared_owner(owner)
        self.register_buffer("owner", owner, persistent=False)  # (K·r,) long: the adapter of each column
        self._rows = rows  # where `own_columns` is shared (None: computed per call)

    @classmethod
    def of(cls, per_adapter: list[list[LoraPair | None]], widths: list[int], in_features: int,
           device, rows: AdapterRows | None = None) -> AdapterStack:
        """`per_adapter[k][j]`: adapter k's pair for fused part j (None: not adapted); part j is `widths[j]`
        outputs wide. Each adapter's parts get ranks side by side and a block-diagonal `up`."""
        downs, ups, owners = [], [], []
        total_out = sum(widths)
        for k, parts in enumerate(per_adapter):
            for j, pair in enumerate(parts):
                if pair is None:
                    continue
                r = pair.a.shape[0]
                if pair.a.shape[1] != in_features or pair.b.shape != (widths[j], r):
                    raise AssetError(f"adapter matrices of shapes {tuple(pair.a.shape)} and {tuple(pair.b.shape)} "
                                     f"do not fit a projection of {in_features} -> {widths[j]}")
                up = torch.zeros(r, total_out, dtype=torch.float32)
                start = sum(widths[:j])
                up[:, start:start + widths[j]] = pair.b.float().t() * pair.scale
                downs.append(pair.a.float())
                ups.append(up)
                owners.append(torch.full((r,), k, dtype=torch.long))
        return cls(torch.cat(downs, 0).to(device), torch.cat(ups, 0).to(device), torch.cat(owners).to(device), rows)

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The delta for x (B, in) or (B, S, in), row b adapted by adapter rows[b] (B,) (BASE: none); in
        x's dtype, computed in float32."""
        if rows.shape[0] != x.shape[0]:
            rows = rows.expand(x.shape[0])  # one session's rows (a lookahead): one adapter for all
        if self._rows is not None and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            own = self._rows.own_columns(self.owner, rows)  # (B, K·r)
        else:  # (a captured step computes them in its graph: the rows' values change between replays)
            own = (rows[:, None] == self.owner[None, :]).float()
        if x.dim() == 3:
            own = own[:, None, :]
        return ((F.linear(x.float(), self.down) * own) @ self.up).to(x.dtype)


class MultiLoraLinear(nn.Module):
    """A base `nn.Linear` plus its `AdapterStack`, reading the rows' adapters from a shared AdapterRows."""

    def __init__(self, base: nn.Linear, stack: AdapterStack, rows: AdapterRows) -> None:
        super().__init__()
        self.base = base
        self.stack = stack
        self._rows = rows  # shared, not a submodule

    @property
    def weight(self) -> torch.Tensor:  # code that reads a projection's weight sees the base's
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._rows.any_adapter:  # only base rows: no delta
            return self.base(x)
        return self.base(x) + self.stack(x, self._rows.rows)


# The projections fused in the fast decode step (fusion.forward.llama), in the order of their outputs.
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj"), "o": ("o_proj",),
         "down": ("down_proj",)}
BLOCK_OF = {"q_proj": "self_attn.", "k_proj": "self_attn.", "v_proj": "self_attn.", "o_proj": "self_attn.",
            "gate_proj": "mlp.", "up_proj": "mlp.", "down_proj": "mlp."}  # where each projection lives in a layer


class MultiAdapter:
    """K adapters installed over one base model, per row: the model's adapted linears become
    `MultiLoraLinear`s (transformers' forward: prefill, chunks), and `fused(layer, name)` gives the
    stacks the fast decode step adds to its fused projections."""

    def __init__(self, model, adapters: list[dict[str, LoraPair]], names: list[str]) -> None:
        if not adapters:
            raise ValueError("MultiAdapter needs at least one adapter")
        self.names = names
        param = next(model.parameters())
        self.rows = AdapterRows(param.device)
        self._fused: dict[tuple[int, str], AdapterStack] = {}
        modules = dict(model.named_modules())
        adapted = sorted({path for a in adapters for path in a})
        unknown = [p for p in adapted if not is_projection(modules.get(p))]
        if unknown:
            raise AssetError(f"adapter {names[0] if len(names) == 1 else names}: {unknown[0]!r} is not a linear "
                             "layer of the base model (another base?)")
        for path in adapted:
            linear = modules[path]
            stack = AdapterStack.of([[a.get(path)] for a in adapters], [linear.out_features], linear.in_features,
                                    param.device, self.rows)
            parent_path, _, child = path.rpartition(".")
            setattr(modules[parent_path], child, MultiLoraLinear(linear, stack, self.rows))
        for index in range(len(model.model.layers)):
            prefix = f"model.layers.{index}."
            for name, members in FUSED.items():
                paths = [prefix + BLOCK_OF[m] + m for m in members]
                if not any(p in a for a in adapters for p in paths):
                    continue
                linears = [modules[p] for p in paths]
                self._fused[(index, name)] = AdapterStack.of(
                    [[a.get(p) for p in paths] for a in adapters], [lin.out_features for lin in linears],
                    linears[0].in_features, param.device, self.rows)
        logger.info("%d adapters over one base: %d projections adapted", len(adapters), len(adapted))

    def fused(self, layer: int, name: str) -> AdapterStack | None:
        """The stack for fused projection `name` ("qkv", "gate_up", "o", "down") of decoder layer `layer`."""
        return self._fused.get((layer, name))
