"""Every fusion rule by name: the training-free ones (`fusion.fuse.rules`) and the learned `route`
(`fusion.fuse.router`). Rules are built here, so neither module needs the other's registry."""

from __future__ import annotations

from typing import Any, Sequence

from fusion.errors import InvalidArgumentError
from fusion.fuse.router import Route
from fusion.fuse.rules import BUILTIN_RULES, FusionRule

RULES: dict[str, type[FusionRule]] = {**BUILTIN_RULES, Route.name: Route}


def known_rules() -> dict[str, type[FusionRule]]:
    return dict(RULES)


def make_rule(name: str, params: dict[str, Any], expert_names: Sequence[str]) -> FusionRule:
    """Build a rule by name; InvalidArgumentError names an unknown rule or a bad parameter."""
    if not expert_names:
        raise InvalidArgumentError("experts: at least one expert is required")
    factory = RULES.get(name)
    if factory is None:
        raise InvalidArgumentError(f"rule: unknown fusion rule {name!r}; known: {sorted(RULES)}")
    try:
        return factory(expert_names, **params)
    except TypeError as err:  # a parameter the rule's signature does not take
        raise InvalidArgumentError(f"fusion.params: {err}") from None
