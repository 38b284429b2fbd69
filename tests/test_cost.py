"""What the shadow side costs the job: the rooms its runs take place on, and the budget over a window."""

from __future__ import annotations

import os
import threading
import time
import types

import pytest
import torch

import shadow
from shadow.core import deadline, sides


def _op_target(upstream):
    ops = types.SimpleNamespace(op=lambda x: x * 2)
    return ops, shadow.Target("op", ops, "op", upstream)


def test_sampled_calls_run_upstream_on_a_room_kept_between_runs():
    """Two sampled calls one after the other run upstream on the same thread (not the caller's), and it keeps no
    mark of the first run's between them."""
    seen = []

    def upstream(x):
        seen.append((threading.current_thread(), getattr(sides.marks, "upstream_side", None) is not None))
        return x * 2

    ops, target = _op_target(upstream)
    with shadow.install([target], sample_rate=1.0, budget=None) as monitor:
        for _ in range(3):
            ops.op(torch.ones(2))
        assert monitor.stats()["op"].match == 3
    rooms = {thread for thread, _ in seen}  # (threads, not rooms: an ident is used again once its thread ended)
    assert len(rooms) == 1 and threading.current_thread() not in rooms and all(marked for _, marked in seen)


def test_a_room_whose_run_raised_or_was_abandoned_is_not_used_again():
    """A run that raised may have left state of its own on its thread, an abandoned one is still busy: the next
    run gets another room, and never waits behind the abandoned one."""
    rooms = []

    def record():
        rooms.append(threading.current_thread())

    def raises():
        record()
        raise ValueError("upstream's own error")

    assert isinstance(deadline.run_within(10, raises).error, ValueError)
    assert deadline.run_within(10, record).finished
    release = threading.Event()

    def hangs():
        record()
        release.wait(30)

    assert not deadline.run_within(0.05, hangs).finished
    found = deadline.run_within(10, lambda: (record(), "after")[1])
    release.set()
    assert found.value == "after"
    assert rooms[0] is not rooms[1] and rooms[2] is not rooms[3]


def test_no_run_waits_behind_a_busy_room_when_runs_overlap():
    """Runs from several threads at once each get a room of their own: all of them are under way together."""
    under_way = threading.Barrier(4, timeout=20)
    results = []

    def caller():
        results.append(deadline.run_within(20, lambda: under_way.wait()).finished)

    callers = [threading.Thread(target=caller) for _ in range(4)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join(30)
    assert results == [True] * 4


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_runs_upstream_on_rooms_of_its_own():
    """The parent's rooms are not in a forked child (only the forking thread is): a run there gets a new room,
    instead of waiting for its deadline on a queue nobody reads."""
    assert deadline.run_within(10, lambda: 1).value == 1  # (the parent has an idle room)
    child = os.fork()
    if child == 0:  # pragma: no cover (the child's outcome is its exit status)
        os._exit(0 if deadline.run_within(5, lambda: 2).value == 2 else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_sampled_call_starts_only_when_the_allowance_covers_its_cost(monkeypatch):
    """Over a 10 s window at budget 0.2 the shadow side may use 0.2 + 0.05 of it (2.5 s). A 0.3 s upstream started
    whenever the allowance was above zero overran it by most of a call (9 runs, 2.7 s); started only when the
    allowance covers the last call's cost, the runs stay within it."""
    clock = [time.monotonic()]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    spent = []

    def slow(x):
        began = time.perf_counter()
        time.sleep(0.3)
        spent.append(time.perf_counter() - began)
        return x * 2

    ops, target = _op_target(slow)
    with shadow.install([target], sample_rate=1.0, budget=0.2) as monitor:
        for _ in range(200):  # 0.05 s of the job's time each: one 10 s window
            clock[0] += 0.05
            ops.op(torch.ones(2))
        stats = monitor.stats()["op"]
    assert sum(spent) <= 0.25 * 10 + 0.05, spent  # (0.05: what a sleep may overrun its 0.3 s)
    assert stats.compared == len(spent) >= 6 and stats.by_reason == {"budget": 200 - len(spent)}, stats
