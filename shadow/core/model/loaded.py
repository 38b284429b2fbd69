"""What a loaded object is, as the comparator reads it: a tree of tensors and plain values.

``torch.load`` returns whatever was pickled: state dicts, but also whole modules, ``argparse.Namespace`` objects,
dataclasses, numpy scalars. Two loads of one checkpoint give two distinct objects, so ``==`` (identity, for most
classes) calls every whole model a divergence. :func:`comparable` turns a loaded object into what it holds, the way
``torch.testing`` pairs leaves: containers stay containers, a tensor stays a tensor, an object becomes its class's
name and its fields (a module: its parameters, buffers, submodules and attributes), a function or class its
qualified name, an object met again a reference to where it was first met (tied weights, cycles), a weak reference
what it refers to within the same side's object graph (an RNN's ``_flat_weight_refs``: never ``==``, which compares
what they refer to, and raises for parameters). What cannot be
read that way (an object with neither fields nor an equality of its own) raises :class:`Uncomparable`: the call is
then a ``comparator`` skip, never a mismatch. Reading runs none of the objects' code: fields are read with
``object.__getattribute__``, types with ``type()``.
"""

from __future__ import annotations

import collections
import types
import weakref
from typing import Any

import numpy as np
import torch

#: Values that are compared as they are (their ``==`` is their value's).
_ATOMS = (
    int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device, torch.Size, torch.layout,
    torch.memory_format, torch.qscheme, range, slice, type(Ellipsis),
)  # fmt: skip
_DICTS = (dict, collections.OrderedDict)
_NAMED = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type, types.ModuleType)
#: How deep and how large a tree may be before it is refused (a 3,000-deep chain must not exhaust the stack).
MAX_DEPTH = 200
MAX_NODES = 1_000_000


class Uncomparable(TypeError):
    """A loaded object holds something that cannot be compared by what it is: the call is a ``comparator`` skip."""


def comparable(obj: Any) -> Any:
    """``obj`` as a tree of containers, tensors and plain values (see the module's docstring).

    Raises:
        Uncomparable: naming the object's type and where in the tree it is.
    """
    return _Reader().read(obj, "", 0)


def qualified_name(obj: Any) -> str:
    """``module.qualname`` of a class or function (``obj`` itself never runs: its attributes are read raw)."""
    module = _raw(obj, "__module__") or "?"
    name = _raw(obj, "__qualname__") or _raw(obj, "__name__") or type(obj).__name__
    return f"{module}.{name}"


def _raw(obj: Any, attribute: str) -> Any:
    try:
        return object.__getattribute__(obj, attribute)
    except Exception:  # (an attribute that is absent, or a slot never set)
        return None


def _fields(obj: Any) -> dict[str, Any] | None:
    """An object's own fields (its ``__dict__`` and its slots), or None where it has neither."""
    found: dict[str, Any] = {}
    own = _raw(obj, "__dict__")
    if isinstance(own, dict):
        found.update(own)
    slots = []
    for cls in type(obj).__mro__:
        declared = vars(cls).get("__slots__") or ()
        slots += [declared] if isinstance(declared, str) else list(declared)
    for name in slots:
        if name not in ("__dict__", "__weakref__"):
            value = _raw(obj, name)
            if value is not None:
                found[name] = value
    return found if own is not None or slots else None


class _Reader:
    def __init__(self) -> None:
        self.seen: dict[int, str] = {}
        self.nodes = 0

    def read(self, obj: Any, path: str, depth: int) -> Any:
        kind = type(obj)
        if kind in _ATOMS or isinstance(obj, torch.Tensor):
            return obj
        self.nodes += 1
        if depth > MAX_DEPTH or self.nodes > MAX_NODES:
            raise Uncomparable(f"the loaded object is deeper than {MAX_DEPTH} or larger than {MAX_NODES:,} nodes")
        if id(obj) in self.seen:  # (met again: tied weights, a cycle; compared by where it was first met)
            return f"<the object at {self.seen[id(obj)] or 'the top'}>"
        self.seen[id(obj)] = path
        if isinstance(obj, _NAMED):
            return f"<{kind.__name__} {qualified_name(obj)}>"
        if isinstance(obj, weakref.ref):
            return self._weak(obj, path, depth)
        if kind in _DICTS or kind is collections.defaultdict:
            return self._dict(obj, path, depth)
        if kind in (list, tuple):
            return kind(self.read(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj))
        if isinstance(obj, tuple) and hasattr(kind, "_fields"):  # a namedtuple
            return kind(*(self.read(v, f"{path}.{name}", depth + 1) for name, v in zip(kind._fields, obj)))
        if kind in (set, frozenset):
            if not all(type(v) in _ATOMS for v in obj):
                raise Uncomparable(f"a {kind.__name__} of objects at {path or 'the top'}")
            return obj
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise Uncomparable(f"a numpy array of objects at {path or 'the top'}")
            return torch.from_numpy(np.array(obj, copy=True))
        if isinstance(obj, np.generic):
            return obj.item() if not isinstance(obj, np.void) else bytes(obj)
        if isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):
            return self._storage(obj)
        return self._object(obj, path, depth)

    def _weak(self, reference: weakref.ref, path: str, depth: int) -> Any:
        """A weak reference as what it refers to in this side's graph: where that was met, or read here."""
        referent = reference()
        if referent is None:
            return "<a dead weak reference>"
        if id(referent) in self.seen:
            return f"<a weak reference to the object at {self.seen[id(referent)] or 'the top'}>"
        return {"__weakref__": self.read(referent, f"{path}()", depth + 1)}

    def _dict(self, obj: dict, path: str, depth: int) -> dict:
        items = {}
        for key, value in obj.items():
            if type(key) not in _ATOMS:
                raise Uncomparable(f"a dict key of type {type(key).__name__} at {path or 'the top'}")
            items[key] = self.read(value, f"{path}[{key!r}]", depth + 1)
        if type(obj) is collections.defaultdict:
            return collections.defaultdict(obj.default_factory, items)
        return type(obj)(items)

    @staticmethod
    def _storage(storage: Any) -> tuple[str, torch.Tensor]:
        untyped = storage if isinstance(storage, torch.UntypedStorage) else storage._untyped_storage
        dtype = "untyped" if isinstance(storage, torch.UntypedStorage) else str(storage.dtype)
        return dtype, torch.empty(0, dtype=torch.uint8, device=untyped.device).set_(untyped)

    def _object(self, obj: Any, path: str, depth: int) -> dict:
        kind = type(obj)
        fields = _fields(obj)
        tree: dict[str, Any] = {"__class__": qualified_name(kind)}
        if isinstance(obj, dict):
            tree["__items__"] = self._dict(dict(obj), path, depth)
        elif isinstance(obj, (list, tuple)):
            tree["__items__"] = [self.read(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]
        elif fields is None:
            if kind.__eq__ is object.__eq__:
                raise Uncomparable(f"a {qualified_name(kind)} at {path or 'the top'}: no fields, no equality")
            tree["__value__"] = obj  # (a value type of its own: its == is its comparison)
            return tree
        for name, value in (fields or {}).items():
            tree[name] = self.read(value, f"{path}.{name}", depth + 1)
        return tree
