"""What the shadow side costs the job: the rooms its runs take place on, and the budget over a window."""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import types

import fakes
import pytest
import torch
from torch.utils._pytree import tree_iter

import shadow
from shadow.core.calls.gate.budget import BURST_SECONDS, Budgets
from shadow.core.model import targets
from shadow.core.runs import deadline, sides
from shadow.core.support import trees


def _three_sampled_calls(upstream):
    """The stats of three sampled calls, one after the other, of a target whose upstream is ``upstream``."""
    ops, target = fakes.op_target(upstream)
    with shadow.install([target], sample_rate=1.0, budget=None) as monitor:
        for _ in range(3):
            ops.op(torch.ones(2))
        return monitor.stats()["op"]


def test_sampled_calls_run_upstream_on_a_room_kept_between_runs():
    """Two sampled calls one after the other run upstream on the same thread (not the caller's), and it keeps no
    mark of the first run's between them."""
    seen = []

    def upstream(x):
        seen.append((threading.current_thread(), getattr(sides.marks, "shadow_side", None) is not None))
        return x * 2

    assert _three_sampled_calls(upstream).match == 3
    rooms = {thread for thread, _ in seen}  # (threads, not rooms: an ident is used again once its thread ended)
    assert len(rooms) == 1 and threading.current_thread() not in rooms and all(marked for _, marked in seen)


def test_a_run_that_leaves_a_setting_of_its_thread_changed_ends_its_room():
    """The settings a run left are read on its thread once it ended: upstream leaving autocast on there (a
    thread-local setting: a difference of the call's) ends its room, and each next run gets another; the caller's
    settings are untouched."""
    seen = []

    def upstream(x):
        seen.append(threading.current_thread())
        torch.set_autocast_enabled("cpu", True)  # (left so, on the shadow side's thread)
        return x * 2

    assert _three_sampled_calls(upstream).mismatch == 3
    assert len(set(seen)) == 3 and threading.current_thread() not in seen
    assert not torch.is_autocast_enabled("cpu")


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


def _within_budget(spent: float, fraction: float, span: float, cost: float) -> None:
    """What the shadow side spent over ``span`` seconds of the clock at budget ``fraction`` (calls of ``cost``):
    never more than the burst and the share (the costs are known: no overrun), and no less than the share less
    what one call costs (the budget compares what it should, not only no more)."""
    assert fraction * span - cost <= spent <= BURST_SECONDS + fraction * span + 1e-9, (spent, fraction * span)


def test_a_sampled_call_starts_only_when_the_allowance_covers_its_cost():
    """At budget 0.2 the shadow side may use 0.2 of the time, and 0.5 s saved up. A 0.3 s upstream started whenever
    the allowance was above zero overran it by most of a call; started only when the allowance covers the last
    call's cost, the runs stay within it, and use all but one call's worth of it."""
    clock, spent = fakes.Clock(), []
    ops, target = fakes.op_target(clock.costing(0.3, spent))
    began = clock()
    with shadow.install([target], sample_rate=1.0, budget=Budgets.of(0.2, clock)) as monitor:
        for _ in range(200):  # 0.05 s of the job's time between calls
            clock.advance(0.05)
            ops.op(torch.ones(2))
        stats = monitor.stats()["op"]
    _within_budget(sum(spent), 0.2, clock() - began, 0.3)
    assert stats.compared == len(spent) >= 7 and stats.by_reason == {"budget": 200 - len(spent)}, stats


def test_the_targets_of_a_monitor_share_one_budget():
    """Two targets, each with a 0.1 s upstream, called in turn at budget 0.2: together they stay within the one
    allowance, and take turns. With an allowance each they spent twice that; sharing one without a reservation,
    the target called first took nearly all of it."""
    clock, spent = fakes.Clock(), []
    (first, a), (second, b) = (
        fakes.op_target(clock.costing(0.1, spent)),
        fakes.op_target(clock.costing(0.1, spent), "other op"),
    )
    began = clock()
    with shadow.install([a, b], sample_rate=1.0, budget=Budgets.of(0.2, clock)) as monitor:
        for _ in range(100):
            clock.advance(0.1)
            first.op(torch.ones(2))
            second.op(torch.ones(2))
        stats = monitor.stats()
    _within_budget(sum(spent), 0.2, clock() - began, 0.1)
    compared = stats["op"].compared, stats["other op"].compared
    assert abs(compared[0] - compared[1]) <= 1, compared  # (turn about)


def test_a_cheap_target_called_often_never_keeps_an_expensive_one_from_the_shared_budget():
    """Ten 5 ms calls of one target for each 0.2 s call of another, every 0.1 s of the job's time at budget 0.2: the
    cheap ones alone would spend the whole refill, so the expensive one never saw 0.2 s saved up; its reservation
    gets it its turns, and the two together still use the budget."""
    clock, spent = fakes.Clock(), []
    (cheap, a), (dear, b) = (
        fakes.op_target(clock.costing(0.005, spent)),
        fakes.op_target(clock.costing(0.2, spent), "dear op"),
    )
    began = clock()
    with shadow.install([a, b], sample_rate=1.0, budget=Budgets.of(0.2, clock)) as monitor:
        for _ in range(100):
            clock.advance(0.1)
            for _ in range(10):
                cheap.op(torch.ones(2))
            dear.op(torch.ones(2))
        stats = monitor.stats()
    _within_budget(sum(spent), 0.2, clock() - began, 0.2)
    assert stats["dear op"].compared >= 5 and stats["op"].compared >= 20, stats  # (without the reservation: 1, 286)


def test_a_call_that_cannot_block_runs_upstream_on_the_callers_thread(legacy_patches):
    """``t.type()`` names the tensor's type (the built-in target's ``never_blocks``): its upstream runs on the
    caller's thread, no room's hand-off; a cast (``t.type(torch.float16)``) runs on a room, within the deadline."""
    ran_on = []
    upstream = torch._C.TensorBase.type

    def recording(*args, **kwargs):
        ran_on.append(threading.current_thread())
        return upstream(*args, **kwargs)

    target = dataclasses.replace(targets.tensor_type(), upstream=recording)
    x = torch.ones(2)
    with shadow.install([target], sample_rate=1.0, budget=None) as monitor:
        assert x.type() == "torch.FloatTensor"
        assert x.type(torch.float16).dtype == torch.float16
        assert monitor.stats()["tensor_type"].match == 2
    assert ran_on[0] is threading.current_thread() and ran_on[1] is not threading.current_thread()


def test_a_never_blocks_that_is_not_callable_is_refused():
    with pytest.raises(ValueError, match="never_blocks must be callable"):
        shadow.Target("op", types.SimpleNamespace(op=abs), "op", abs, never_blocks=True)


def test_the_leaves_of_a_call_are_torchs_pytree_leaves():
    """``trees.leaves`` opens tuples, lists and dicts itself and leaves every other node to torch's pytree: the
    same leaves as ``tree_iter``, in its order."""
    pair = collections.namedtuple("pair", "a b")
    x, module = torch.ones(2), torch.nn.Linear(1, 1)
    cases = [
        (),
        ((x,), {}),
        ((x, 1, None, "s"), {"k": x, "j": [x, (2.0, torch.float16)]}),
        pair(x, 1),
        ((pair(x, 2),), {}),
        collections.OrderedDict(b=x, a=1),
        torch.Size([2, 3]),
        ([[]], {}),
        {"b": 1, "a": 2},
        ((module, [module]), {}),
    ]
    for case in cases:
        found = trees.leaves(case)
        assert len(found) == len(list(tree_iter(case))) and all(
            a is b for a, b in zip(found, tree_iter(case), strict=True)
        ), case
    assert trees.leaves(x)[0] is x


def test_a_run_on_the_callers_thread_leaves_the_callers_settings_as_legacy_left_them():
    """Upstream run on the caller's thread (``never_blocks``) that turns grad mode off (thread-local) and the
    default dtype to float64 (global): the caller finds both as legacy left them, the call a ``state`` mismatch, the
    caller's result legacy's."""
    ran_on = []

    def upstream(x):
        ran_on.append(threading.current_thread())
        torch.set_grad_enabled(False)
        torch.set_default_dtype(torch.float64)
        return x * 2

    ops, target = fakes.op_target(upstream)
    target = dataclasses.replace(target, never_blocks=lambda args, kwargs: True)
    dtype = torch.get_default_dtype()
    with shadow.install([target], sample_rate=1.0, budget=None) as monitor:
        x = torch.ones(2)
        assert ops.op(x).tolist() == [2.0, 2.0] and x.tolist() == [1.0, 1.0]
        assert torch.is_grad_enabled() and torch.get_default_dtype() == dtype
        stats = monitor.stats()["op"]
    assert ran_on == [threading.current_thread()]
    assert stats.mismatch == 1 and stats.by_reason == {"state": 1}, stats


def test_threads_starting_sampled_calls_together_share_the_budget():
    """Sixteen threads sampled at the same moment, at budget 0.05 (0.5 s saved up), each call's upstream taking
    0.2 s: every call that starts takes its expected cost at once, so not all sixteen pass the check before any is
    charged (they spent 3.2 s before), and the 0.5 s saved up gets at least two of them compared."""
    clock, spent = fakes.Clock(), []
    ops, target = fakes.op_target(clock.costing(0.2, spent))
    start = threading.Barrier(16)

    def call():
        start.wait()
        ops.op(torch.ones(2))

    began = clock()
    with shadow.install([target], sample_rate=1.0, budget=Budgets.of(0.05, clock)) as monitor:
        for _ in range(2):  # (the second round: the first round's measured cost is known)
            threads = [threading.Thread(target=call) for _ in range(16)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        stats = monitor.stats()["op"]
    assert stats.calls == 32 and stats.by_reason.get("budget", 0) >= 24, stats
    assert 2 <= stats.compared == len(spent), stats
    assert sum(spent) <= BURST_SECONDS + 0.05 * (clock() - began) + 4 * 0.2, sum(spent)  # (4: the unknown cost's)
