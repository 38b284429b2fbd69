"""torch_npu's own legacy functions, executed from its source without importing torch_npu.

torch_npu needs Ascend's CANN libraries to import, but the patches npu-shadow compares are plain Python in
``torch_npu/utils/_module.py`` and ``torch_npu/utils/tensor_methods.py``. :func:`load` reads those files from a
torch_npu wheel or an installed distribution (never importing the package, never loading its compiled
extension), takes only the definitions the patches need (no module-level code runs), and executes them with
the names they use bound to the accelerator this host has:

- ``torch.npu`` is torch_npu's own: on a real NPU the installed torch_npu's; on the emulated npu torch_npu's runtime
  Python from the same source (``set_device``, ``device``, ``current_stream``, ``stream``, ``Stream``... of
  ``torch_npu/npu/utils.py`` and ``streams.py``, :data:`RUNTIME`) over the emulator's ``torch_npu._C``
  (:mod:`shadow.npu.emulated.torch_npu_c`), anything else the device module's; on a CUDA host the functions see
  ``torch.cuda`` as ``torch.npu`` and the device string ``'npu'`` reads ``'cuda'`` (the one named device branch);
- ``torch_npu.npu.amp.autocast`` is torch_npu's own autocast class, from its source;
- ``torch_npu.npu.<Bool..BFloat16>Tensor`` are the device module's tensor type classes;
- ``pta_error``/``ErrCode`` are torch_npu's own (``torch_npu/utils/_error_code.py``), from source, with
  ``torch_npu._C._npu_getLocalDevice`` the emulator's (thread-local, -1 when unset, as torch_npu's) or, on other
  hosts, ``torch.accelerator.current_device_index``.

Imports those definitions need are taken from the file's own import statements, for the standard library and
torch only. A release without an expected definition fails with :class:`LegacySourceError` naming it.
"""

from __future__ import annotations
import __future__

import ast
import builtins
import copy
import dataclasses
import importlib
import importlib.metadata
import itertools
import os
import symtable
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from shadow.npu import catalog
from shadow.npu import legacy_host as host
from shadow.npu.emulated import formats, torch_npu_c
from shadow.npu.patching import LEGACY_ORIGIN_ATTRIBUTE, LEGACY_PATCHED, Patches, replace, upstream_of
from shadow.npu.release_files import (  # noqa: F401  (the release readers, re-exported here)
    MAX_MEMBER_BYTES,
    MAX_SYNTAX_DEPTH,
    LegacySourceError,
    ReleaseFiles,
    _parse,
    parse,
    printable,
)
from shadow.npu.tensor_types import NPU_TENSOR_TYPES


@dataclasses.dataclass(frozen=True)
class Patch:
    """One of torch_npu's patches that a built-in target shadows: the definition torch_npu installs (``member``'s
    ``definition``) on ``owner.attribute`` (``owner`` a dotted path of torch), with the ``helpers`` it installs
    beside it (``Module.cast_weight``, which ``Module.to`` and ``Module.npu`` call on the module)."""

    target: str
    member: str
    definition: str
    owner: str
    attribute: str
    helpers: tuple[tuple[str, str, str], ...] = ()  # (definition, owner, attribute)


#: Every patch npu-shadow can shadow, by built-in target (one row each: :data:`shadow.npu.catalog.CATALOG`). A release
#: that lacks one of them lacks that target.
PATCHES: tuple[Patch, ...] = tuple(
    Patch(row.name, row.file, row.definition, row.owner, row.attribute, row.helpers) for row in catalog.CATALOG
)

#: torch_npu's runtime Python that the patches call through ``torch.npu`` (device and stream handling), run from
#: the same source where the accelerator is the emulated npu: ``torch_npu.npu.<name>`` for each name.
RUNTIME: dict[str, tuple[str, ...]] = {
    "torch_npu/npu/utils.py": (
        "set_device",
        "current_device",
        "device",
        "synchronize",
        "stream",
        "set_stream",
        "current_stream",
        "default_stream",
        "_get_device_index",
    ),
    "torch_npu/npu/streams.py": ("Stream", "Event"),
}

#: More of torch_npu's runtime Python, where a release has it: the format settings ``Module.cast_weight`` reads,
#: over the emulator's ``torch_npu._C`` (``is_available`` and ``get_device_name`` are the emulated device module's).
RUNTIME_WHERE_PRESENT: dict[str, tuple[str, ...]] = {
    "torch_npu/npu/npu_config.py": ("get_mm_bmm_format_nd", "is_jit_compile_false"),
}

_LOADS = itertools.count(1)

#: Top-level packages whose imports the extracted definitions may use.
_IMPORTABLE = frozenset(
    {
        "torch",
        "typing",
        "collections",
        "itertools",
        "threading",
        "functools",
        "os",
        "sys",
        "re",
        "time",
        "enum",
        "ctypes",
        "warnings",
        "contextlib",
        "io",
        "pickle",
        "copy",
    }
)

#: Globals the definitions probe for inside ``try: ... except NameError`` (IPython's marker).
_PROBED = frozenset({"__IPYTHON__"})

TENSOR_TYPE_NAMES = tuple(NPU_TENSOR_TYPES)

ORIGIN_ATTRIBUTE = LEGACY_ORIGIN_ATTRIBUTE


@dataclasses.dataclass(frozen=True)
class TorchNpuLegacy:
    """torch_npu's legacy functions, loaded from one release's source: ``patches`` by built-in target (see
    :data:`PATCHES`), and ``missing``, why each target this release cannot give is missing."""

    version: str
    source: str
    #: The legacy function of each target this release patches: ``patches["tensor_type"]`` is ``_npu_type``.
    patches: Mapping[str, Callable]
    #: The targets of :data:`PATCHES` this release lacks, each with why (no such definition, ...).
    missing: Mapping[str, str]
    #: ``_parallel_apply(modules, inputs, kwargs_tup=None, devices=None)``, which the DataParallel patches call.
    parallel_apply_function: Callable | None
    #: torch_npu's tensor type table: 'torch.npu.FloatTensor' and 'torch_npu.npu.FloatTensor' -> class.
    tensor_types: Mapping[str, type]
    #: The runtime functions (``torch_npu.npu.set_device``, ...) loaded from this source (:data:`RUNTIME`), by
    #: name; empty where the host's own ``torch.npu`` serves (a real NPU's torch_npu, or CUDA's).
    runtime: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: The helpers installed beside the patches (``Module.cast_weight``), by (owner, attribute).
    helpers: Mapping[tuple[str, str], Callable] = dataclasses.field(default_factory=dict)

    @property
    def tensor_type(self) -> Callable | None:
        """``_npu_type(self, dtype=None, non_blocking=False, **kwargs)``: ``Tensor.type``'s patch (to 2.12)."""
        return self.patches.get("tensor_type")

    @property
    def parallel_apply(self) -> Callable | None:
        """``npu_parallel_apply(self, replicas, inputs, kwargs)``: ``DataParallel.parallel_apply``'s patch."""
        return self.patches.get("parallel_apply")

    @property
    def data_parallel(self) -> Callable | None:
        """``npu_data_parallel(module, inputs, device_ids=None, ...)``: ``nn.parallel.data_parallel``'s patch."""
        return self.patches.get("data_parallel")

    @property
    def origin(self) -> str:
        """How doctor and the summary name this legacy."""
        return f"torch_npu {self.version} source (from {self.source})"

    def patch_torch(self) -> Patches:
        """Install these functions the way torch_npu does; returns the handle that undoes it."""
        replacements: list[tuple[Any, str, Any]] = []
        for patch in PATCHES:
            function = self.patches.get(patch.target)
            if function is None:
                continue
            owner = _owner(patch.owner)
            if patch.target == "tensor_type":  # (torch_npu keeps upstream's as type_raw)
                replacements.append((owner, "type_raw", torch._C.TensorBase.type))
            replacements.append((owner, patch.attribute, function))
        for (owner, attribute), function in self.helpers.items():
            replacements.append((_owner(owner), attribute, function))
        patches = replace(replacements)
        LEGACY_PATCHED.announce()  # a monitor installed by `npu-shadow run` moves over the new legacy
        return patches


def _owner(dotted: str) -> Any:
    """The module or class a dotted path of torch names (``torch.nn.Module``, ``torch.nn.parallel``)."""
    try:
        return importlib.import_module(dotted)
    except ImportError:
        module, _, name = dotted.rpartition(".")
        return getattr(_owner(module), name)


def origin_of(function: Any) -> str | None:
    """'torch_npu X source' for a function :func:`load` made, else None."""
    return getattr(function, ORIGIN_ATTRIBUTE, None)


# --------------------------------------------------------------------------- reading the source


def _definitions(tree: ast.Module) -> dict[str, ast.stmt]:
    return {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def _global_names(nodes: list[ast.stmt]) -> set[str]:
    """The global names the definitions read (their own names excepted)."""
    table = symtable.symtable(ast.unparse(ast.Module(body=nodes, type_ignores=[])), "<legacy>", "exec")
    names = {s.get_name() for s in table.get_symbols() if s.is_referenced()}  # bases, decorators, defaults
    pending = list(table.get_children())
    while pending:
        child = pending.pop()
        pending.extend(child.get_children())
        names.update(s.get_name() for s in child.get_symbols() if s.is_global() and s.is_referenced())
    return names - {getattr(n, "name", "") for n in nodes}


def _imported(tree: ast.Module) -> dict[str, tuple[str, str | None]]:
    """Top-level imports: bound name -> (module, attribute or None)."""
    bound: dict[str, tuple[str, str | None]] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = (alias.name, None)
                else:
                    top = alias.name.partition(".")[0]
                    bound[top] = (top, None)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                bound[alias.asname or alias.name] = (node.module, alias.name)
    return bound


class _Loader:
    def __init__(self, source: ReleaseFiles, version: str, device: tuple[str, Any] | None = None) -> None:
        self.source = source
        self.version = version
        # (``device``: a check that defines the functions and calls none of them needs no accelerator)
        self.device_type, self.device_module = device or host.device_module()
        self.torch_npu_c = host.emulated_torch_npu_c() if self.device_type == "npu" else None
        self.namespaces: dict[str, dict[str, Any]] = {}
        self.trees: dict[str, ast.Module] = {}
        self.package = self._package()
        #: The loaded files' modules are named under this (one prefix per load: two loads never share globals).
        self.module_prefix = f"_npu_shadow_legacy_{next(_LOADS)}.torch_npu_{self.version.replace('.', '_')}"
        self.builtins = dict(builtins.__dict__, __import__=self._import)
        if self.device_type == "npu" and self.torch_npu_c is None:
            self.torch = torch  # a real NPU: torch.npu is the installed torch_npu's own
        else:
            self.torch = host.TorchView(self.package.npu)

    def _package(self) -> types.ModuleType:
        package = types.ModuleType("torch_npu")
        if self.torch_npu_c is not None:
            npu = host.NpuModule(self.device_module)
            package._C = self.torch_npu_c
            # torch_npu.npu._lazy_init lives in module state (torch_npu/npu/__init__.py), not in a definition the
            # loader takes: the emulator's initialisation stands in for it (nothing to wait for).
            npu._lazy_init = self.torch_npu_c._npu_init
        else:
            npu = host.NpuModule(self.device_module)
            package._C = types.SimpleNamespace(
                _npu_getLocalDevice=torch.accelerator.current_device_index,
                _npu_set_thread_affinity=lambda start, end: None,  # (torch_npu's binding is for NPU hosts)
                _npu_reset_thread_affinity=lambda: None,
                # (a storage's bytes as a tensor: the emulator's works on any device)
                _tensor_construct_from_storage=torch_npu_c._tensor_construct_from_storage,
            )
        emulated = self.torch_npu_c is not None
        package.npu_format_cast = formats.cast if emulated else host.npu_format_cast
        package.get_npu_format = formats.get if emulated else host.get_npu_format
        package.Format = formats.Format
        for name in TENSOR_TYPE_NAMES:
            cls = getattr(self.device_module, name, None)
            if cls is not None:
                setattr(npu, name, cls)
        package.npu = npu
        return package

    def load_runtime(self) -> dict[str, Any]:
        """torch_npu's runtime functions (:data:`RUNTIME`) from the source, set on ``torch_npu.npu``, where the
        accelerator is the emulated npu; {} elsewhere."""
        if self.torch_npu_c is None:
            return {}
        loaded = {}
        for member, names in RUNTIME.items():
            namespace = self.execute(member, names)
            for name in names:
                loaded[name] = namespace[name]
                setattr(self.package.npu, name, namespace[name])
        for member, names in RUNTIME_WHERE_PRESENT.items():
            try:
                namespace = self.execute(member, names)
            except LegacySourceError:
                continue  # (an older release: host.NpuModule's defaults, torch_npu's own, stand in)
            for name in names:
                loaded[name] = namespace[name]
                setattr(self.package.npu, name, namespace[name])
        return loaded

    def _import(self, name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        # Imports inside the definitions (``import torch_npu._C`` in pta_error): never the real torch_npu.
        if level != 0 or name.partition(".")[0] != "torch_npu":
            return builtins.__import__(name, globals, locals, fromlist, level)
        if not fromlist or name in ("torch_npu", "torch_npu._C"):
            return self.package if name == "torch_npu" or not fromlist else self.package._C
        return types.SimpleNamespace(**self.execute(name.replace(".", "/") + ".py", tuple(fromlist)))

    def _resolve(self, module: str, attribute: str | None, bound_as: str, member: str) -> Any:
        top = module.partition(".")[0]
        if top == "torch_npu":
            if attribute is None:
                return self.package
            if module in ("torch_npu", "torch_npu._C"):
                return getattr(self.package if module == "torch_npu" else self.package._C, attribute)
            return self.execute(module.replace(".", "/") + ".py", (attribute,))[attribute]
        if top not in _IMPORTABLE:
            raise LegacySourceError(f"torch_npu {self.version}: {member} needs {module}, outside torch and stdlib")
        if top == "torch" and attribute is None and bound_as == "torch":
            return self.torch
        imported = importlib.import_module(module)
        return imported if attribute is None else getattr(imported, attribute)

    def _constant(self, value: ast.expr, imports: dict[str, tuple[str, str | None]], member: str) -> Any:
        """A module-level value the definitions read, as data: a literal, or an attribute of an imported torch
        object (``origin_mpdl_iter_init = _MultiProcessingDataLoaderIter.__init__``: upstream's, also where a
        legacy patch or a monitor is installed over it now)."""
        try:
            return ast.literal_eval(value)
        except ValueError:
            pass
        chain: list[str] = []
        while isinstance(value, ast.Attribute):
            chain.insert(0, value.attr)
            value = value.value
        if not (isinstance(value, ast.Name) and value.id in imports and chain):
            raise LegacySourceError(f"torch_npu {self.version}: {member} sets {ast.unparse(value)} by code, not data")
        owner = self._resolve(*imports[value.id], value.id, member)
        for attribute in chain[:-1]:
            owner = getattr(owner, attribute)
        found = getattr(owner, chain[-1])
        if getattr(found, LEGACY_ORIGIN_ATTRIBUTE, None) is not None or hasattr(found, "__npu_shadow__"):
            found = upstream_of(owner, chain[-1]) or getattr(found, "__wrapped__", found)
        return found

    def _tree(self, member: str) -> ast.Module:
        if member not in self.trees:
            text = self.source.read(member)
            if text is None:
                raise LegacySourceError(f"torch_npu {self.version} ({self.source.path}): {member} is missing")
            self.trees[member] = _parse(text, member)
        return self.trees[member]

    def _namespace(self, member: str) -> dict[str, Any]:
        namespace = self.namespaces.get(member)
        if namespace is None:
            # A module of its own, importable by its name (torch.compile imports a traced function's module by
            # its __name__), never named torch_npu: nothing here may pass for the real package.
            name = f"{self.module_prefix}.{member.removesuffix('.py').replace('/', '.')}"
            module = types.ModuleType(name)
            module.__file__ = f"{self.source.path}!{member}"
            module.__builtins__ = self.builtins
            sys.modules[name] = module
            namespace = self.namespaces[member] = vars(module)
        return namespace

    def execute(self, member: str, names: tuple[str, ...]) -> dict[str, Any]:
        """Define ``names`` from ``member`` (with the definitions of that file they use, and the names they
        import from other torch_npu files, loaded the same way) in the file's namespace; returns it. A dotted name
        (``installer.definition``) is a definition nested in one of the file's functions (:meth:`_nested`), bound
        under that dotted name."""
        where = f"torch_npu {self.version} ({self.source.path}): {member}"
        tree = self._tree(member)
        definitions = _definitions(tree)
        namespace = self._namespace(member)
        nested = [n for n in names if "." in n and n not in namespace]
        wanted = [n for n in names if "." not in n and n not in namespace]
        missing = [n for n in wanted if n not in definitions]
        if missing:
            raise LegacySourceError(f"{where} has no {missing[0]!r}")
        selected: dict[str, ast.stmt] = {}
        while wanted:  # the file's own definitions that the selection uses, transitively
            name = wanted.pop()
            if name in selected or name in namespace:
                continue
            selected[name] = definitions[name]
            wanted.extend(n for n in _global_names([definitions[name]]) if n in definitions)
        if selected:
            nodes = [node for node in tree.body if getattr(node, "name", None) in selected]  # in source order
            self._run(nodes, tree, member, namespace)
        for name in nested:
            namespace[name] = self._nested(member, name)
        return namespace

    def _run(self, nodes: list[ast.stmt], tree: ast.Module, member: str, namespace: dict[str, Any]) -> None:
        """Bind the global names ``nodes`` read (imports, module-level data, the package) in ``namespace``, then
        compile and run ``nodes`` there (definitions only: no module-level code)."""
        where = f"torch_npu {self.version} ({self.source.path}): {member}"
        definitions = _definitions(tree)
        imports = _imported(tree)
        constants = _constants(tree)
        for name in sorted(_global_names(nodes) - set(namespace)):
            if name in definitions:
                continue
            if name in imports:
                namespace[name] = self._resolve(*imports[name], name, member)
            elif name in constants:
                namespace[name] = self._constant(constants[name], imports, member)
            elif name == "torch_npu":
                namespace[name] = self.package
            elif not hasattr(builtins, name) and name not in _PROBED:
                raise LegacySourceError(f"{where}: the legacy code uses {name!r}, which the file does not import")
        # The file's imports, never run (``if False:``), so that the compiler sees which names are modules, as it
        # does compiling the whole file (Python 3.11 calls a module's functions without LOAD_METHOD).
        never = ast.If(test=ast.Constant(False), body=_imports(tree) or [ast.Pass()], orelse=[])
        module = ast.fix_missing_locations(ast.Module(body=[never, *nodes], type_ignores=[]))
        if self.device_type != "npu":
            module = ast.fix_missing_locations(host.DeviceRename(self.device_type).visit(module))
        # torch_npu's own compiler flags (its file's __future__ imports), never this module's
        code = compile(module, namespace["__file__"], "exec", flags=_future_flags(tree), dont_inherit=True)
        exec(code, namespace)

    def _nested(self, member: str, dotted: str) -> Callable:
        """The definition ``installer.name``: a function torch_npu defines inside the function that installs it
        (``apply_npu_internal_format_repr_patch``'s ``_npu_internal_format_repr``).

        The installer's body is run without what it does to the process: its imports, definitions and
        ``name = <literal or attribute of torch>`` statements are kept (the attribute read as data by
        :meth:`_constant`: upstream's function where a patch or a monitor is there now, the one torch_npu saves as
        ``_orig_repr``), everything else (the assignment that installs the patch, calls) is left out; then it
        returns ``name``, a closure over those values."""
        where = f"torch_npu {self.version} ({self.source.path}): {member}"
        installer_name, _, name = dotted.partition(".")
        tree = self._tree(member)
        installer = _definitions(tree).get(installer_name)
        if not isinstance(installer, ast.FunctionDef):
            raise LegacySourceError(f"{where} has no function {installer_name!r}")
        arguments = installer.args
        if arguments.posonlyargs or arguments.args or arguments.kwonlyargs or arguments.vararg or arguments.kwarg:
            raise LegacySourceError(f"{where}: {installer_name} takes arguments: not an installer")
        local_imports = _imported(ast.Module(body=_imports(ast.Module(body=installer.body, type_ignores=[])),
                                             type_ignores=[]))  # fmt: skip
        imports = {**_imported(tree), **local_imports}
        namespace = self._namespace(member)
        body: list[ast.stmt] = []
        for node in installer.body:
            if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)):
                body.append(node)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                bound = f"__npu_shadow_{installer_name}_{node.targets[0].id}"
                namespace[bound] = self._constant(node.value, imports, member)
                read = ast.Assign(targets=node.targets, value=ast.Name(bound, ast.Load()))
                body.append(ast.fix_missing_locations(ast.copy_location(read, node)))
        if not any(isinstance(node, ast.FunctionDef) and node.name == name for node in body):
            raise LegacySourceError(f"{where}: {installer_name} defines no {name!r}")
        body.append(ast.fix_missing_locations(ast.copy_location(ast.Return(ast.Name(name, ast.Load())), body[-1])))
        factory = copy.copy(installer)
        factory.name, factory.body, factory.decorator_list = "__npu_shadow_installer__", body, []
        uses = [n for n in _global_names([factory]) if n in _definitions(tree)]
        if uses:
            self.execute(member, tuple(uses))
        self._run([factory], tree, member, namespace)
        return namespace.pop("__npu_shadow_installer__")()


def _constants(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level ``NAME = value`` statements: name -> value (read as data by :meth:`_Loader._constant`)."""
    found: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            found[node.target.id] = node.value
    return found


def _imports(tree: ast.Module) -> list[ast.stmt]:
    """The file's top-level import statements, but ``from __future__`` (a compiler flag, see below)."""
    return [
        node
        for node in tree.body
        if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.module != "__future__")
    ]


def _future_flags(tree: ast.Module) -> int:
    """The compiler flags of a file's ``from __future__ import ...`` statements."""
    flags = 0
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            for alias in node.names:
                flags |= getattr(__future__, alias.name).compiler_flag
    return flags


def check(path: str | os.PathLike) -> str:
    """The torch_npu version at ``path``, once its files are found to define one of the patches npu-shadow shadows
    (read only: nothing runs, no accelerator needed). Raises :class:`LegacySourceError` saying what is missing."""
    source = ReleaseFiles(path)
    try:
        version = source.version()
        trees: dict[str, ast.Module | None] = {}
        for patch in PATCHES:
            if patch.member not in trees:
                text = source.read(patch.member)
                trees[patch.member] = None if text is None else _parse(text, patch.member)
            tree = trees[patch.member]
            if tree is not None and patch.definition in _definitions(tree):
                return version
        raise LegacySourceError(f"torch_npu {version} ({source.path}) defines none of the patches npu-shadow shadows")
    finally:
        source.close()


def load(path: str | os.PathLike) -> TorchNpuLegacy:
    """torch_npu's legacy functions from a wheel file, a directory holding the ``torch_npu`` package (e.g.
    site-packages) or ``'installed'`` (the distribution installed here, found without importing it): each patch of
    :data:`PATCHES` the release has; the others are in :attr:`TorchNpuLegacy.missing`, with why.

    Raises :class:`LegacySourceError` when the path holds no torch_npu source, the source has none of the patches,
    or this host has no accelerator for them to run on.
    """
    source = ReleaseFiles(path)
    patches: dict[str, Callable] = {}
    helpers: dict[tuple[str, str], Callable] = {}
    missing: dict[str, str] = {}
    try:
        version = source.version()
        loader = _Loader(source, version)
        runtime = loader.load_runtime()
        for patch in PATCHES:
            try:
                namespace = loader.execute(patch.member, (patch.definition, *(h[0] for h in patch.helpers)))
            except LegacySourceError as exc:
                missing[patch.target] = str(exc)
                continue
            patches[patch.target] = namespace[patch.definition]
            for definition, owner, attribute in patch.helpers:
                helpers[(owner, attribute)] = namespace[definition]
    finally:
        source.close()
    if not patches:
        raise LegacySourceError(
            f"torch_npu {version} ({source.path}) has none of the patches npu-shadow shadows: "
            + "; ".join(f"{target}: {why}" for target, why in missing.items())
        )
    methods = loader.namespaces.get("torch_npu/utils/tensor_methods.py", {})
    cache = methods.get("_NPUTensortypeCache") if "tensor_type" in patches else None
    if cache is not None:
        cache.tensortype_list_dict_init()
    origin = f"torch_npu {version} source"
    parallel_apply_function = loader.namespaces.get(catalog.row("parallel_apply").file, {}).get("_parallel_apply")
    for function in (*patches.values(), *helpers.values(), parallel_apply_function):
        if function is not None:
            setattr(function, ORIGIN_ATTRIBUTE, origin)
    return TorchNpuLegacy(
        version=version,
        source=str(source.path),
        patches=types.MappingProxyType(patches),
        missing=types.MappingProxyType(missing),
        parallel_apply_function=parallel_apply_function,
        tensor_types=types.MappingProxyType(dict(cache.get_tensortype_dict()) if cache is not None else {}),
        runtime=types.MappingProxyType(runtime),
        helpers=types.MappingProxyType(helpers),
    )


def _statement_at(tree: ast.Module, line: int) -> tuple[ast.Assign, ast.FunctionDef | None] | None:
    """The assignment at ``line`` of a file, and the top-level function it is in (None: at module level)."""
    for node in tree.body:
        for inner in ast.walk(node):
            if isinstance(inner, ast.Assign) and inner.lineno == line:
                return inner, node if isinstance(node, ast.FunctionDef) else None
    return None


def _installed_definition(tree: ast.Module, member: str, line: int, where: str) -> tuple[str, Any]:
    """What the assignment at ``line`` installs, read from the syntax alone: ``("here", name)`` (a definition of
    the file, ``installer.name`` for one nested in the function that installs it) or ``("imported", (module,
    attribute))`` (one the file imports from another torch_npu file). Raises LegacySourceError for anything else."""
    found = _statement_at(tree, line)
    if found is None:
        raise LegacySourceError(f"{where}: no assignment there")
    statement, installer = found
    value = statement.value
    if not isinstance(value, ast.Name):
        raise LegacySourceError(
            f"{where} installs {printable(ast.unparse(value))[:80]}: the result of code run at import, not a "
            "definition npu-shadow can load on its own"
        )
    name = value.id
    if installer is not None and any(isinstance(n, ast.FunctionDef) and n.name == name for n in installer.body):
        return "here", f"{installer.name}.{name}"
    if name in _definitions(tree):
        return "here", name
    imports = {
        **_imported(tree),
        **(_imported(ast.Module(body=_imports(installer), type_ignores=[])) if installer else {}),
    }
    if name in imports and imports[name][0].partition(".")[0] == "torch_npu":
        return "imported", imports[name]
    raise LegacySourceError(f"{where} installs {name!r}, which is no definition of a torch_npu file")


def check_installed(path: str | os.PathLike, member: str, line: int) -> None:
    """Raise :class:`LegacySourceError` unless the assignment at ``member``:``line`` installs a definition that
    :func:`installed_function` can load: it is loaded as there (its definitions made, none of them called), with no
    accelerator (one that is not an npu's device module stands in)."""
    _installed(path, member, line, device=("npu", types.SimpleNamespace()))


def installed_function(path: str | os.PathLike, member: str, line: int) -> Callable:
    """The function torch_npu installs with the assignment at ``member``:``line`` (a patch the census found there),
    loaded from its source as the built-in targets' legacy is: a definition of that file, one nested in the function
    that installs it, or one the file imports from another torch_npu file.

    Raises :class:`LegacySourceError` where the statement installs anything else (the result of a call: a wrapper
    made at import time, a lambda), naming it, or where this host has no accelerator."""
    return _installed(path, member, line)


def _installed(path: str | os.PathLike, member: str, line: int, device: tuple[str, Any] | None = None) -> Callable:
    source = ReleaseFiles(path)
    try:
        version = source.version()
        loader = _Loader(source, version, device)
        loader.load_runtime()
        tree = loader._tree(member)
        kind, name = _installed_definition(tree, member, line, f"torch_npu {version}: {member}:{line}")
        if kind == "here":
            function = loader.execute(member, (name,))[name]
        else:
            function = loader._resolve(*name, name[1] or name[0], member)
    finally:
        source.close()
    if not callable(function):
        raise LegacySourceError(f"torch_npu {version}: {member}:{line} installs {name!r}, which is not a function")
    setattr(function, ORIGIN_ATTRIBUTE, f"torch_npu {version} source")
    return function
