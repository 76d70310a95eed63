"""Autoscaling on the load the replicas report themselves.

Decode traffic reaches the expert replicas over their own gRPC servers and clients reach the
coordinator over its own, so Serve's request counters stay at zero. Each replica reports instead
(`record_autoscaling_stats`) its `fusion_load`: sessions with a cached prefix on an expert replica,
requests in flight on a coordinator. This policy asks for enough replicas that each carries about
`target_ongoing_requests` of that load; Serve then applies min/max_replicas, the up/down-scaling
delays and factors of the deployment's `autoscaling_config`.
"""

from __future__ import annotations

import math
from typing import Any

LOAD_METRIC = "fusion_load"


def fusion_load_policy(ctx) -> tuple[int, dict[str, Any]]:
    """Desired replicas = ceil(total load / target per replica); without reports yet, no change."""
    reports = (ctx.aggregated_metrics or {}).get(LOAD_METRIC) or {}
    if not reports:
        return ctx.target_num_replicas, {}
    target = getattr(ctx.config, "target_ongoing_requests", None) or 2.0
    load = sum(float(v) for v in reports.values())
    return math.ceil(load / target), {}
