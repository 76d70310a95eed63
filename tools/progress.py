"""One-line progress for long work (fetch, training): a bar, the share done and the time left."""

from __future__ import annotations


def progress_line(fraction: float, elapsed_s: float, width: int = 20) -> str:
    """`[#######.............]  35%  1m10s elapsed, about 2m10s left` (time left from the rate so far)."""
    fraction = min(max(fraction, 0.0), 1.0)
    filled = round(fraction * width)
    left = elapsed_s * (1 - fraction) / fraction if fraction > 0 else None
    eta = f"about {_duration(left)} left" if left is not None else "estimating the time left"
    return f"[{'#' * filled}{'.' * (width - filled)}] {fraction:4.0%}  {_duration(elapsed_s)} elapsed, {eta}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"
