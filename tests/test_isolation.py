"""The one failure-isolation policy: a failing batched call is retried in halves until each error lands
on the items that cause it; an error of a fatal type fails its whole call without retries."""

from __future__ import annotations

import pytest

from fusion.errors import ExpertUnavailableError
from fusion.experts.isolation import isolate_failures


def doubled_unless_bad(bad: set[int], calls: list[list[int]]):
    def run(items):
        calls.append(list(items))
        if bad & set(items):
            raise ValueError(f"bad items {sorted(bad & set(items))}")
        return [2 * item for item in items]
    return run


@pytest.mark.parametrize("bad", [set(), {3}, {0, 7}, {1, 2, 5}, set(range(8))])
def test_errors_land_on_the_items_that_cause_them(bad):
    items = list(range(8))
    calls: list[list[int]] = []
    done, errors = isolate_failures(doubled_unless_bad(bad, calls), items)
    assert sorted(errors) == sorted(bad)
    assert all(isinstance(err, ValueError) for err in errors.values())
    served = [i for positions, _ in done for i in positions]
    assert served == [i for i in items if i not in bad]  # in order
    assert [r for _, results in done for r in results] == [2 * i for i in served]  # each call's own results
    assert calls[0] == items  # one call when nothing fails
    if not bad:
        assert len(calls) == 1
    else:  # each bad item ends in a call of its own
        assert all([i] in calls for i in bad)


def test_a_fatal_error_fails_its_call_at_once():
    calls: list[list[int]] = []

    def gone(items):
        calls.append(list(items))
        raise ExpertUnavailableError("no replica answers")

    done, errors = isolate_failures(gone, [10, 11, 12], fatal=(ExpertUnavailableError,))
    assert done == [] and sorted(errors) == [0, 1, 2] and calls == [[10, 11, 12]]


def test_no_items_no_call():
    assert isolate_failures(lambda items: pytest.fail("called"), []) == ([], {})
