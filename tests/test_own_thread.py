"""fusion.own_thread: one named thread for work that must always run on the same thread."""

from __future__ import annotations

import gc
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from fusion.own_thread import OwnThread


def test_work_runs_on_the_one_thread_from_any_caller_and_inline_on_it():
    started = []
    own = OwnThread("test-own", initializer=lambda: started.append(threading.current_thread().name))
    assert not own.is_current()
    with ThreadPoolExecutor(max_workers=3) as callers:
        names = set(callers.map(lambda _: own.run(lambda: threading.current_thread().name), range(12)))
    assert len(names) == 1 and next(iter(names)).startswith("test-own")
    assert started == list(names)  # the initializer ran once, there
    # Called on the thread itself, work runs inline (queued, it would wait for the work calling it).
    assert own.run(lambda: own.run(lambda: own.is_current())) is True
    with pytest.raises(ZeroDivisionError):
        own.run(lambda: 1 / 0)
    assert own.run(lambda: "still serving") == "still serving"


def test_an_own_thread_let_go_of_ends_its_thread():
    own = OwnThread("test-own-ends")
    thread = own.run(threading.current_thread)
    assert thread.is_alive()
    del own
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()
