"""Vocabulary alignment for experts that share a tokenizer but differ in logits width.

Models of one family often pad their embedding rows (e.g. 49,152 ids in the tokenizer, 49,216 rows
in the output layer). Fusion runs over the ids every expert can produce; the padded tail is cut off,
so the sampler can never pick an id some expert has no row for. Experts with different tokenizers
are refused here: their ids mean different strings; they fuse over text (`fusion.crosstok.step`), which the
service selects (the token engine then only serves description and limits: `mixed=True`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from fusion.errors import ConfigError
from fusion.experts.expert import ExpertInfo


@dataclass(frozen=True)
class VocabAlignment:
    width: int  # fused vocabulary: ids [0, width)
    expert_widths: tuple[int, ...]

    @classmethod
    def from_infos(cls, infos: Sequence[ExpertInfo], *, mixed: bool = False) -> VocabAlignment:
        if not infos:
            raise ConfigError("experts: at least one expert is required")
        lead = infos[0]
        for other in infos[1:] if not mixed else ():
            if other.tokenizer_fingerprint != lead.tokenizer_fingerprint:
                raise ConfigError(
                    f"experts {lead.name!r} and {other.name!r} use different tokenizers "
                    f"({lead.tokenizer_fingerprint} vs {other.tokenizer_fingerprint}); "
                    "token-level fusion needs a shared tokenizer (the service fuses such experts over text)"
                )
        width = min(min(i.vocab_size for i in infos), min(i.tokenizer_size for i in infos))
        return cls(width=width, expert_widths=tuple(i.vocab_size for i in infos))

    def stack(self, per_expert: Sequence[torch.Tensor]) -> torch.Tensor:
        """Stack each expert's (B, V_i) logits over the shared ids: (E, B, width)."""
        return torch.stack([logits[..., : self.width] for logits in per_expert])
