"""One failure-isolation policy for a batched call: when a call over a batch raises, its halves are
called again, recursively, so the error lands only on the items that cause it (a history past the
context, a released session, an out-of-memory batch) while the rest of the batch is served. Used by
the engine for each expert's step and by the expert server for the calls it batches into one forward.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence, TypeVar

logger = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")


def isolate_failures(
    run: Callable[[Sequence[Item]], Result],
    items: Sequence[Item],
    *,
    fatal: tuple[type[BaseException], ...] = (),
    what: str = "batch",
) -> tuple[list[tuple[list[int], Result]], dict[int, Exception]]:
    """`run(items)`, and on failure `run` over each half of them, recursively down to single items.

    Returns the calls that succeeded, as (the indices of `items` they covered, in order; what `run`
    returned for them), and the error of every item that failed alone, by index. An error of a type in
    `fatal` (the whole callee is gone) fails every item of its call at once: retrying parts of it
    cannot succeed."""
    done: list[tuple[list[int], Result]] = []
    errors: dict[int, Exception] = {}

    def attempt(indices: list[int]) -> None:
        try:
            done.append((indices, run([items[i] for i in indices])))
            return
        except fatal as err:
            errors.update({i: err for i in indices})
            return
        except Exception as err:  # noqa: BLE001  isolated below, then reported per item
            if len(indices) == 1:
                errors[indices[0]] = err
                return
            logger.warning("a %s of %d failed (%s); retrying it in halves", what, len(indices), type(err).__name__)
        half = len(indices) // 2
        attempt(indices[:half])
        attempt(indices[half:])

    if items:
        attempt(list(range(len(items))))
    return done, errors
