"""The patch call counter's mechanism, run by a Python with ``sys.monitoring`` (3.12+) and without torch
(``tests/test_patch_calls.py`` runs it): the functions at the counted places stay themselves (identity, pickling,
signature, source, code, recursion headroom), the job's calls are counted and the shadow side's and the monitor's
own are not, each closure of one factory counts its own calls, a forked child counts from zero, and uninstalling
leaves everything as it was. Prints "ok" (an assertion's failure otherwise)."""

from __future__ import annotations

import inspect
import json
import os
import pickle
import sys
import types

from shadow.core.calls import patch_calls
from shadow.core.calls.patch_calls import C_FUNCTION, PatchCalls
from shadow.core.runs.sides import SAMPLED_CALLS, marks

SOURCE = """
def op(x):
    return x + 1

def make(k):
    def made(x):
        return x * k
    return made

made_a, made_b = make(2), make(3)

class Holder:
    @staticmethod
    def static(x):
        return x

def deep(n):
    return 0 if n == 0 else 1 + deep(n - 1)
"""

ops = types.ModuleType("job_ops")
sys.modules["job_ops"] = ops
exec(compile(SOURCE, "job_ops.py", "exec"), vars(ops))
ops.c_len = len
NAMES = ["job_ops.op", "job_ops.made_a", "job_ops.made_b", "job_ops.Holder.static", "job_ops.c_len", "job_ops.deep",
         "job_ops.absent", "job_ops.Holder"]  # fmt: skip


def pickled(value: object) -> object:
    try:
        return pickle.dumps(value)
    except Exception as exc:  # (a closure: the same failure with and without the counter)
        return type(exc).__name__


def what_the_job_sees() -> dict:
    seen = {}
    for name in NAMES:
        owner, attribute = patch_calls._place(name)
        raw = inspect.getattr_static(owner, attribute, None)
        value = getattr(owner, attribute, None)
        code = getattr(value, "__code__", None)
        seen[name] = (
            id(raw), id(value), hash(value), pickled(value),
            str(inspect.signature(value)) if callable(value) and not isinstance(value, type) else None,
            code.co_code if code is not None else None, getattr(code, "co_firstlineno", None),
        )  # fmt: skip
    return seen


def deepest() -> int:
    """How deep the job's recursion through a counted function can go under this recursion limit."""
    low, high = 1, 5000
    while low < high:
        middle = (low + high + 1) // 2
        try:
            ops.deep(middle)
            low = middle
        except RecursionError:
            high = middle - 1
    return low


sys.setrecursionlimit(600)
before, depth = what_the_job_sees(), deepest()
codes = {name: getattr(ops, name.split(".")[1]).__code__ for name in ("job_ops.made_a", "job_ops.made_b")}
counters = PatchCalls(NAMES)
counters.install()
assert counters.counted == ("job_ops.op", "job_ops.made_a", "job_ops.made_b", "job_ops.Holder.static",
                            "job_ops.deep"), counters.counted  # fmt: skip
assert counters.uncounted == {"job_ops.c_len": C_FUNCTION}, counters.uncounted
assert what_the_job_sees() == before  # (the very objects; the closures' code an equal copy of its own)
assert ops.made_a.__code__ == codes["job_ops.made_a"] and ops.made_a.__code__ is not ops.made_b.__code__
assert deepest() >= depth - 1, (deepest(), depth)  # (the counter's own frame, only at a function's start)
table = {ops.op: "a dict keyed by the function"}
assert table[ops.op] and ops.op is vars(ops)["op"]

ops.op(1), ops.op(2), ops.made_a(1), ops.Holder.static(1), ops.Holder().static(2)
counted = counters.counts()
assert counted["job_ops.op"] == 2 and counted["job_ops.made_a"] == 1 and counted["job_ops.made_b"] == 0, counted
assert counted["job_ops.Holder.static"] == 2 and counted["job_ops.deep"] >= depth, counted

SAMPLED_CALLS.count += 1  # (a sampled call under way somewhere: calls are told apart)
marks.shadow_side = object()
ops.op(1)  # the shadow side's: not counted
marks.shadow_side = None
exec(compile("import job_ops\njob_ops.op(1)\n", "own.py", "exec"), {"__name__": "shadow.core.fake"})  # the tool's
ops.op(1)  # the job's own, while the sampled call is under way: counted
SAMPLED_CALLS.count -= 1
assert counters.counts()["job_ops.op"] == 3, counters.counts()
assert counters.since_reported()["job_ops.op"] == 3

ops.op(1)  # (not yet reported when the child forks: the parent's to report)
read, write = os.pipe()
child = os.fork()
if child == 0:
    try:
        mine = counters.counts()
        ops.op(1), ops.op(1)
        os.write(write, json.dumps([mine, counters.since_reported()]).encode())
    finally:
        os._exit(0)
os.waitpid(child, 0)
at_fork, reported = json.loads(os.read(read, 65536))
assert set(at_fork.values()) == {0}, at_fork  # (the child starts from zero)
assert reported == {"job_ops.op": 2}, reported  # (its own calls only)
assert counters.since_reported() == {"job_ops.op": 1}  # (the parent reports its own)

counters.uninstall()
ops.op(1)
assert counters.counts()["job_ops.op"] == 4  # (no longer counted)
assert ops.made_a.__code__ is codes["job_ops.made_a"]  # (its own code back)
assert what_the_job_sees() == before and patch_calls.STARTS.tool is None
print("ok")
