"""torch's pytree, flattened without leaving reference cycles behind.

``torch.utils._pytree.tree_flatten`` recurses through a nested closure that refers to itself, so every call
leaves a small reference cycle for the garbage collector (seven objects). A sampled call flattens several trees,
and a job that checks ``gc.collect() == 0`` after a step (PyTorch's own DataParallel tests do) would see them.
These helpers use the same registry, node definitions and ``TreeSpec`` through a module-level recursion, which
leaves no cycle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch.utils import _pytree as pytree

IsLeaf = Callable[[Any], bool] | None


def _flatten_into(node: Any, is_leaf: IsLeaf, leaves: list[Any]) -> pytree.TreeSpec:
    if pytree.tree_is_leaf(node, is_leaf=is_leaf):
        leaves.append(node)
        return pytree._LEAF_SPEC
    node_type = pytree._get_node_type(node)
    children, context = pytree.SUPPORTED_NODES[node_type].flatten_fn(node)
    return pytree.TreeSpec(node_type, context, [_flatten_into(child, is_leaf, leaves) for child in children])


def flatten(tree: Any, is_leaf: IsLeaf = None) -> tuple[list[Any], pytree.TreeSpec]:
    """``tree_flatten``: the leaves and the spec."""
    leaves: list[Any] = []
    return leaves, _flatten_into(tree, is_leaf, leaves)


def flatten_with_paths(tree: Any, dataclasses_as_leaves: bool = False) -> tuple[list[tuple[Any, Any]], pytree.TreeSpec]:
    """``tree_flatten_with_path``: (key path, leaf) pairs and the spec (``dataclasses_as_leaves``: a dataclass
    instance is a leaf, for the caller to open)."""
    is_leaf = is_dataclass_instance if dataclasses_as_leaves else None
    _, spec = flatten(tree, is_leaf)
    return list(pytree._generate_key_paths((), tree, is_leaf)), spec


def is_dataclass_instance(node: Any) -> bool:
    """Whether ``node`` is a dataclass instance (a leaf for :func:`flatten_with_paths`' ``dataclasses_as_leaves``)."""
    return dataclasses.is_dataclass(node) and not isinstance(node, type)


def leaves(tree: Any) -> list[Any]:
    """``list(tree_iter(tree))``: tuples, lists and dicts (those exact types) are opened here, anything else that is
    no pytree node is a leaf, and a tree holding any other node goes to torch's ``tree_iter``. (A sampled call looks
    at the leaves of its arguments several times; most calls pass a few tensors and numbers.)"""
    found: list[Any] = []
    return found if _plain_into(tree, found) else list(pytree.tree_iter(tree))


def _plain_into(node: Any, found: list[Any]) -> bool:
    kind = type(node)
    if kind is tuple or kind is list:
        return all(_plain_into(child, found) for child in node)
    if kind is dict:
        return all(_plain_into(child, found) for child in node.values())
    if kind in pytree.SUPPORTED_NODES or isinstance(node, tuple):  # (a namedtuple, a structseq: torch's to open)
        return False
    found.append(node)
    return True


def map_only(kind: type | tuple[type, ...], function: Callable[[Any], Any], tree: Any) -> Any:
    """``tree_map_only``: ``tree`` with ``function`` applied to the leaves that are instances of ``kind``."""
    leaves, spec = flatten(tree)
    return spec.unflatten([function(leaf) if isinstance(leaf, kind) else leaf for leaf in leaves])
