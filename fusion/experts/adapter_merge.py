"""Experts that are a base model plus a PEFT adapter (`adapter:` in an expert's config).

Teams fine-tune small specialists as LoRA adapters in the PEFT format (`adapter_config.json` +
`adapter_model.safetensors`). An adapter loads through peft's own path (a local folder or a hub id)
over the already-loaded base and is merged into its weights, so the expert decodes at the speed of
its base with every decode path (`fast`, `static`) unchanged.
"""

from __future__ import annotations

import logging
from pathlib import Path

from fusion.errors import AssetError
from fusion.models import resolve_adapter

logger = logging.getLogger(__name__)


def apply_adapter(model, adapter: str, expert_name: str):
    """`model` with the PEFT adapter at `adapter` (a folder or a hub id) merged into its weights."""
    from peft import PeftConfig, PeftModel

    adapter = resolve_adapter(adapter)
    looks_local = adapter.startswith((".", "/", "~")) or Path(adapter).exists()
    if looks_local and not (Path(adapter).expanduser() / "adapter_config.json").is_file():
        raise AssetError(f"expert {expert_name!r}: no PEFT adapter (adapter_config.json) in {adapter}")
    try:
        config = PeftConfig.from_pretrained(adapter)
        base = getattr(model.config, "_name_or_path", "")
        if config.base_model_name_or_path and base and (
                Path(config.base_model_name_or_path).name.lower() != Path(base).name.lower()):
            logger.warning("expert %s: adapter %s was trained on %s, applied to %s", expert_name, adapter,
                           config.base_model_name_or_path, base)
        merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise AssetError(f"expert {expert_name!r}: cannot apply adapter {adapter!r}: {first_line}") from None
    logger.info("expert %s: merged adapter %s", expert_name, adapter)
    return merged
