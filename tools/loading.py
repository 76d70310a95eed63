"""Loading a service for the tools (the command line, eval, bench, benchmarks): the default config, the
model cache, and the local build with what it lacks prepared first, explicitly and with progress."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import fusion
from fusion.config import FusionConfig, load_config
from fusion.models import default_cache_dir
from fusion.models import model_resolver as runtime_resolver

DEFAULT_CONFIG = Path(fusion.__file__).parent / "configs" / "default.yaml"  # shipped with the runtime


def cache_dir(option: Optional[Path]) -> Path:
    return option if option is not None else default_cache_dir()


def read_config(path: Optional[Path]) -> FusionConfig:
    return load_config(path or DEFAULT_CONFIG)


def model_resolver(cache: Path, *, prepare: bool) -> Callable[[str], str]:
    """`builtin:` refs to cache folders; with `prepare`, missing ones are fetched first
    (servers never prepare: they refuse to start, naming the command)."""
    if not prepare:
        return runtime_resolver(cache)
    from fusion.tools.assets import prepare_model

    return lambda ref: prepare_model(ref, cache)


def load_service(config: FusionConfig, cache: Path, *, router: bool = True):
    """The build of `config` a tool runs (experts with `addresses` remote, as `fusion serve` has them,
    the others in-process), preparing what is missing first, explicitly and with progress: builtin models
    (fetched) and, with `router`, a `router: auto` router for experts that have none shipped (the
    default trio's ships with the project: nothing trains for it)."""
    from fusion.services.coordinator import build_service

    service = build_service(config, model_resolver(cache, prepare=True), cache, require_router=False)
    if router and service.uses_auto_router:
        from fusion.tools.router_training import prepare_router  # trains only if the cache lacks it

        try:
            prepare_router(service)
        except BaseException:
            service.close()
            raise
    return service
