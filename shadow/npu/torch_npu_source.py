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
import dataclasses
import email.parser
import importlib
import importlib.metadata
import itertools
import os
import symtable
import sys
import types
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from shadow.npu.patching import LEGACY_ORIGIN_ATTRIBUTE
from shadow.npu.tensor_types import NPU_TENSOR_TYPES

#: The torch_npu releases that carry the patches (torch_npu 2.13 removed them).
RELEASES = ("2.8.0", "2.9.0", "2.10.0", "2.11.0", "2.12.0")

#: Releases after them, read by ``npu-shadow census`` (what torch_npu still patches); fetched into the cache too.
LATER_RELEASES = ("2.13.0", "2.14.0")

#: What torch_npu must define for the legacy patches; what these use (torch_npu's autocast, its error codes, the
#: tensor type table) is loaded from the files they import it from, as far as they use it.
DEFINITIONS: dict[str, tuple[str, ...]] = {
    "torch_npu/utils/tensor_methods.py": ("_npu_type",),
    "torch_npu/utils/_module.py": ("_parallel_apply", "npu_parallel_apply", "npu_data_parallel"),
}

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
    }
)

#: Globals the definitions probe for inside ``try: ... except NameError`` (IPython's marker).
_PROBED = frozenset({"__IPYTHON__"})

TENSOR_TYPE_NAMES = tuple(NPU_TENSOR_TYPES)

ORIGIN_ATTRIBUTE = LEGACY_ORIGIN_ATTRIBUTE


class LegacySourceError(ValueError):
    """The given path holds no usable torch_npu source; the message names what is missing."""


@dataclasses.dataclass(frozen=True)
class TorchNpuLegacy:
    """torch_npu's legacy functions, loaded from one release's source."""

    version: str
    source: str
    #: ``_npu_type(self, dtype=None, non_blocking=False, **kwargs)``: ``Tensor.type``'s patch.
    tensor_type: Callable
    #: ``npu_parallel_apply(self, replicas, inputs, kwargs)``: ``DataParallel.parallel_apply``'s patch.
    parallel_apply: Callable
    #: ``npu_data_parallel(module, inputs, device_ids=None, ...)``: ``torch.nn.parallel.data_parallel``'s patch.
    data_parallel: Callable
    #: ``_parallel_apply(modules, inputs, kwargs_tup=None, devices=None)``, which the two above call.
    parallel_apply_function: Callable
    #: torch_npu's tensor type table: 'torch.npu.FloatTensor' and 'torch_npu.npu.FloatTensor' -> class.
    tensor_types: Mapping[str, type]
    #: The runtime functions (``torch_npu.npu.set_device``, ...) loaded from this source (:data:`RUNTIME`), by
    #: name; empty where the host's own ``torch.npu`` serves (a real NPU's torch_npu, or CUDA's).
    runtime: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def origin(self) -> str:
        """How doctor and the summary name this legacy."""
        return f"torch_npu {self.version} source (from {self.source})"

    def patch_torch(self) -> Any:
        """Install these functions the way torch_npu does; returns the handle that undoes it."""
        from shadow.npu import reference

        return reference.patch_torch(self.tensor_type, self.parallel_apply, self.data_parallel)


def origin_of(function: Any) -> str | None:
    """'torch_npu X source' for a function :func:`load` made, else None."""
    return getattr(function, ORIGIN_ATTRIBUTE, None)


# --------------------------------------------------------------------------- reading the source


class ReleaseFiles:
    """The files of one torch_npu release: a wheel (zip) or a directory holding the ``torch_npu`` package."""

    def __init__(self, path: str | os.PathLike) -> None:
        text = os.fspath(path)
        if text == "installed":
            try:
                distribution = importlib.metadata.distribution("torch_npu")
            except importlib.metadata.PackageNotFoundError:
                raise LegacySourceError("no torch_npu distribution is installed in this environment") from None
            text = os.fspath(distribution.locate_file(""))
        self.path = Path(text)
        self._zip: zipfile.ZipFile | None = None
        self._root: Path | None = None
        if self.path.is_file():
            try:
                self._zip = zipfile.ZipFile(self.path)
            except zipfile.BadZipFile:
                raise LegacySourceError(f"{self.path} is neither a torch_npu wheel nor a directory") from None
        elif (self.path / "torch_npu" / "utils").is_dir():
            self._root = self.path
        elif self.path.name == "torch_npu" and (self.path / "utils").is_dir():
            self._root = self.path.parent
        else:
            raise LegacySourceError(f"{self.path}: no torch_npu wheel or torch_npu package there")

    def read(self, member: str) -> str | None:
        try:
            data = self._zip.read(member) if self._zip is not None else (self._root / member).read_bytes()
        except (KeyError, FileNotFoundError, IsADirectoryError):
            return None
        return data.decode("utf-8").replace("\r\n", "\n")

    def _names(self) -> Iterator[str]:
        if self._zip is not None:
            yield from self._zip.namelist()
        else:
            for entry in self._root.glob("torch_npu-*.dist-info/METADATA"):
                yield entry.relative_to(self._root).as_posix()

    def python_files(self) -> Iterator[str]:
        """The package's ``.py`` files, as members (``torch_npu/utils/_module.py``)."""
        if self._zip is not None:
            yield from (n for n in self._zip.namelist() if n.startswith("torch_npu/") and n.endswith(".py"))
        else:
            for path in sorted((self._root / "torch_npu").rglob("*.py")):
                yield path.relative_to(self._root).as_posix()

    def version(self) -> str:
        """From the distribution's METADATA, else ``torch_npu/version.py`` (read as data, never run)."""
        for name in self._names():
            if name.startswith("torch_npu-") and name.endswith(".dist-info/METADATA"):
                metadata = email.parser.Parser().parsestr(self.read(name) or "")
                if metadata.get("Name", "").replace("-", "_") == "torch_npu" and metadata.get("Version"):
                    return metadata["Version"]
        text = self.read("torch_npu/version.py")
        if text is not None:
            for node in ast.parse(text).body:
                if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__version__" for t in node.targets):
                    value = node.value
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        return value.value
        return "unknown"

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()


def _parse(text: str, member: str) -> ast.Module:
    with warnings.catch_warnings():  # (old files have invalid escapes in code we never run)
        warnings.simplefilter("ignore")
        return ast.parse(text, filename=member)


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


class _DeviceRename(ast.NodeTransformer):
    """``'npu'`` -> the accelerator's type, for hosts whose accelerator is not an npu."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        if node.value == "npu":
            return ast.copy_location(ast.Constant(self.device_type), node)
        return node


# --------------------------------------------------------------------------- binding to this host


class _TorchView(types.ModuleType):
    """``torch`` as torch_npu's code sees it where ``torch.npu`` is not torch_npu's (the emulated npu, CUDA)."""

    def __init__(self, device_module: Any) -> None:
        super().__init__("torch")
        self.npu = device_module

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _NpuModule(types.ModuleType):
    """``torch_npu.npu`` (which torch_npu also makes ``torch.npu``) on the emulated npu: torch_npu's runtime
    functions from its source (set on it by the loader), anything else the emulated device module's."""

    def __init__(self, device_module: Any) -> None:
        super().__init__("torch_npu.npu")
        self._device_module = device_module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._device_module, name)


def _emulated_torch_npu_c() -> Any:
    """The emulator's ``torch_npu._C`` where the accelerator is the emulated npu, else None."""
    from shadow.npu import emulated

    if not emulated.installed_devices():
        return None
    from shadow.npu.emulated import torch_npu_c

    return torch_npu_c


def _device_module() -> tuple[str, Any]:
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        raise LegacySourceError(
            "torch_npu's legacy needs an accelerator (an NPU, CUDA, or the emulated npu: --emulate-npu); "
            "this host has none"
        )
    return accelerator.type, torch.get_device_module(accelerator.type)


class _Loader:
    def __init__(self, source: ReleaseFiles, version: str) -> None:
        self.source = source
        self.version = version
        self.device_type, self.device_module = _device_module()
        self.torch_npu_c = _emulated_torch_npu_c() if self.device_type == "npu" else None
        self.namespaces: dict[str, dict[str, Any]] = {}
        self.trees: dict[str, ast.Module] = {}
        self.package = self._package()
        #: The loaded files' modules are named under this (one prefix per load: two loads never share globals).
        self.module_prefix = f"_npu_shadow_legacy_{next(_LOADS)}.torch_npu_{self.version.replace('.', '_')}"
        self.builtins = dict(builtins.__dict__, __import__=self._import)
        if self.torch_npu_c is not None:
            self.torch = _TorchView(self.package.npu)
        elif self.device_type == "npu":
            self.torch = torch  # a real NPU: torch.npu is the installed torch_npu's own
        else:
            self.torch = _TorchView(self.device_module)

    def _package(self) -> types.ModuleType:
        package = types.ModuleType("torch_npu")
        if self.torch_npu_c is not None:
            npu = _NpuModule(self.device_module)
            package._C = self.torch_npu_c
            # torch_npu.npu._lazy_init lives in module state (torch_npu/npu/__init__.py), not in a definition the
            # loader takes: the emulator's initialisation stands in for it (nothing to wait for).
            npu._lazy_init = self.torch_npu_c._npu_init
        else:
            npu = types.ModuleType("torch_npu.npu")
            package._C = types.SimpleNamespace(_npu_getLocalDevice=torch.accelerator.current_device_index)
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

    def _tree(self, member: str) -> ast.Module:
        if member not in self.trees:
            text = self.source.read(member)
            if text is None:
                raise LegacySourceError(f"torch_npu {self.version} ({self.source.path}): {member} is missing")
            self.trees[member] = _parse(text, member)
        return self.trees[member]

    def execute(self, member: str, names: tuple[str, ...]) -> dict[str, Any]:
        """Define ``names`` from ``member`` (with the definitions of that file they use, and the names they
        import from other torch_npu files, loaded the same way) in the file's namespace; returns it."""
        where = f"torch_npu {self.version} ({self.source.path}): {member}"
        tree = self._tree(member)
        definitions = _definitions(tree)
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
        wanted = [n for n in names if n not in namespace]
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
        if not selected:
            return namespace
        nodes = [node for node in tree.body if getattr(node, "name", None) in selected]  # in source order
        imports = _imported(tree)
        for name in sorted(_global_names(nodes) - set(namespace)):
            if name in definitions:
                continue
            if name in imports:
                namespace[name] = self._resolve(*imports[name], name, member)
            elif name == "torch_npu":
                namespace[name] = self.package
            elif not hasattr(builtins, name) and name not in _PROBED:
                raise LegacySourceError(f"{where}: the legacy code uses {name!r}, which the file does not import")
        # The file's imports, never run (``if False:``), so that the compiler sees which names are modules, as it
        # does compiling the whole file (Python 3.11 calls a module's functions without LOAD_METHOD).
        never = ast.If(test=ast.Constant(False), body=_imports(tree) or [ast.Pass()], orelse=[])
        module = ast.fix_missing_locations(ast.Module(body=[never, *nodes], type_ignores=[]))
        if self.device_type != "npu":
            module = ast.fix_missing_locations(_DeviceRename(self.device_type).visit(module))
        # torch_npu's own compiler flags (its file's __future__ imports), never this module's
        code = compile(module, namespace["__file__"], "exec", flags=_future_flags(tree), dont_inherit=True)
        exec(code, namespace)  # definitions only: no module-level code
        return namespace


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
    """The torch_npu version at ``path``, once its files are found to define what the patches need (read only:
    nothing runs, no accelerator needed). Raises :class:`LegacySourceError` naming what is missing."""
    source = ReleaseFiles(path)
    try:
        version = source.version()
        for member, names in DEFINITIONS.items():
            text = source.read(member)
            if text is None:
                raise LegacySourceError(f"torch_npu {version} ({source.path}): {member} is missing")
            missing = [n for n in names if n not in _definitions(_parse(text, member))]
            if missing:
                raise LegacySourceError(f"torch_npu {version} ({source.path}): {member} has no {missing[0]!r}")
        return version
    finally:
        source.close()


def load(path: str | os.PathLike) -> TorchNpuLegacy:
    """torch_npu's legacy functions from a wheel file, a directory holding the ``torch_npu`` package (e.g.
    site-packages) or ``'installed'`` (the distribution installed here, found without importing it).

    Raises :class:`LegacySourceError` when the path holds no torch_npu source, the source lacks a definition
    the patches need, or this host has no accelerator for it to run on.
    """
    source = ReleaseFiles(path)
    try:
        version = source.version()
        loader = _Loader(source, version)
        runtime = loader.load_runtime()
        for member, names in DEFINITIONS.items():
            loader.execute(member, names)
    finally:
        source.close()
    methods = loader.namespaces["torch_npu/utils/tensor_methods.py"]
    module = loader.namespaces["torch_npu/utils/_module.py"]
    cache = methods["_NPUTensortypeCache"]
    cache.tensortype_list_dict_init()
    origin = f"torch_npu {version} source"
    legacy = TorchNpuLegacy(
        version=version,
        source=str(source.path),
        tensor_type=methods["_npu_type"],
        parallel_apply=module["npu_parallel_apply"],
        data_parallel=module["npu_data_parallel"],
        parallel_apply_function=module["_parallel_apply"],
        tensor_types=types.MappingProxyType(dict(cache.get_tensortype_dict())),
        runtime=types.MappingProxyType(runtime),
    )
    for function in (legacy.tensor_type, legacy.parallel_apply, legacy.data_parallel, legacy.parallel_apply_function):
        setattr(function, ORIGIN_ATTRIBUTE, origin)
    return legacy


def wheel_cache() -> Path:
    """Where the test command keeps torch_npu wheels: ``$NPU_SHADOW_WHEEL_DIR``, else ``wheels`` under
    ``$NPU_SHADOW_CACHE_DIR`` (default ``~/.cache/npu-shadow``)."""
    explicit = os.environ.get("NPU_SHADOW_WHEEL_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("NPU_SHADOW_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "npu-shadow"
    )
    return Path(base) / "wheels"


def cached_wheel(version: str) -> Path | None:
    """The cached torch_npu wheel of ``version``, if one is there."""
    matches = sorted(wheel_cache().glob(f"torch_npu-{version}-*.whl"))
    return matches[0] if matches else None
