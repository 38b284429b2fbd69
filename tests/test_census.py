"""`npu-shadow census`: what a torch_npu release replaces in torch, read from its source alone. A package written
here checks each way of patching and each way of reaching a patch; the cached wheels check the releases."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import zipfile

import pytest
from commands import npu_shadow
from torch_npu_wheels import wheel

from shadow.analysis import census, census_cache
from shadow.npu.torch_npu_source import MAX_MEMBER_BYTES, LegacySourceError, ReleaseFiles
from shadow.npu.wheels import LATER_RELEASES, RELEASES

PACKAGE = {
    "torch_npu/__init__.py": """
        import os
        import torch
        from torch_npu.utils import apply_all
        from torch_npu._init.patches import api_patches  # noqa

        apply_all()
        if os.environ.get("TORCH_NPU_OPTION"):
            from torch_npu.contrib import optional  # noqa
        """,
    "torch_npu/utils/__init__.py": """
        from ._module import apply_all
        """,
    "torch_npu/utils/_module.py": """
        import torch
        import torch.nn as nn
        from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter as Iterator
        from torch_npu.contrib import function as npu_functional

        TABLE = [["nn.functional", npu_functional]]


        def to(self, *args, **kwargs):
            return self


        def _apply(table):
            for destination, module in table:
                for name in module.__all__:
                    setattr(getattr(torch, destination), name, getattr(module, name))


        def apply_all():
            nn.Module.to = to
            Iterator.__init__ = lambda self, loader: None
            setattr(torch.Tensor, "type", to)
            _apply(TABLE)


        def never_called():
            torch.save = None
        """,
    "torch_npu/contrib/__init__.py": "",
    "torch_npu/contrib/function.py": """
        __all__ = ["npu_fused_thing"]


        def npu_fused_thing(x):
            return x
        """,
    "torch_npu/contrib/optional.py": """
        import torch

        torch.cuda.is_available = lambda: True
        """,
    "torch_npu/contrib/opt_in.py": """
        import torch as t


        def _init():
            t.jit.script = lambda f: f


        _init()
        """,
    "torch_npu/_init/__init__.py": "",
    "torch_npu/_init/patches/__init__.py": "",
    "torch_npu/_init/patches/api_patches.py": """
        from torch_npu._init.patches.patch_manager import PatchManager


        @PatchManager.register_patch("api")
        def apply_api_patches():
            from ..serialization import _add_serialization_methods

            _add_serialization_methods()
        """,
    "torch_npu/_init/patches/patch_manager.py": """
        class PatchManager:
            @classmethod
            def register_patch(cls, group):
                return lambda fn: fn
        """,
    "torch_npu/_init/serialization.py": """
        import torch


        def load(*args, **kwargs):
            return None


        def _add_serialization_methods():
            torch.load = load
        """,
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("release")
    for member, text in PACKAGE.items():
        path = root / member
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


@pytest.fixture(scope="module")
def found(written):
    return {p.name: p for p in census.take(str(written)).patches}


def _line(written, patch: census.Patch) -> str:
    return (written / patch.file).read_text().splitlines()[patch.line - 1].strip()


def test_every_way_of_patching_is_found_through_the_aliases_that_name_torch(written, found):
    assert _line(written, found["torch.nn.Module.to"]) == "nn.Module.to = to"  # import torch.nn as nn
    iterator = found["torch.utils.data.dataloader._MultiProcessingDataLoaderIter.__init__"]  # from-import, as
    assert _line(written, iterator).startswith("Iterator.__init__ =") and iterator.function == "apply_all"
    assert _line(written, found["torch.Tensor.type"]) == 'setattr(torch.Tensor, "type", to)'  # a constant name
    table = found["torch.nn.functional.npu_fused_thing"]  # a patch table: each name of the module's __all__
    assert table.table == "TABLE" and table.function == "apply_all"
    assert _line(written, found["torch.jit.script"]) == "t.jit.script = lambda f: f"  # import torch as t


def test_when_a_patch_is_applied_follows_the_code_that_reaches_it(found):
    assert found["torch.nn.Module.to"].applied == "import"  # through a re-export in the package's __init__
    assert found["torch.load"].applied == "import"  # registered with the patch manager, a relative import
    assert found["torch.cuda.is_available"].applied == "import, conditionally"  # imported under an if
    assert found["torch.jit.script"].applied == "import torch_npu.contrib.opt_in"  # only that import applies it
    assert found["torch.save"].applied == "when called"  # no module's top level reaches it


def test_each_patch_is_judged_against_this_environments_torch(found):
    assert found["torch.nn.Module.to"].kind == "in place"
    assert found["torch.utils.data.dataloader._MultiProcessingDataLoaderIter.__init__"].kind == "constructor"
    assert found["torch.load"].kind == "function"
    assert found["torch.nn.functional.npu_fused_thing"].kind == "addition"
    assert found["torch.Tensor.type"].shadowed_by == "tensor_type"
    assert found["torch.load"].shadowed_by == "torch_load"
    assert found["torch.nn.Module.to"].shadowed_by == "module_to"
    assert found["torch.utils.data.dataloader._MultiProcessingDataLoaderIter.__init__"].shadowed_by == "dataloader_init"


def test_a_source_that_is_no_release_is_refused(tmp_path):
    with pytest.raises(LegacySourceError, match="no torch_npu wheel, directory or cached version"):
        census.take("0.0.1-nonexistent")
    (tmp_path / "torch_npu" / "utils").mkdir(parents=True)
    with pytest.raises(LegacySourceError, match=r"no torch_npu/__init__\.py"):
        census.take(str(tmp_path))


# ------------------------------------------------------------------------------------------------ the releases


@pytest.fixture(scope="module")
def releases():
    """Each release's census, taken by the command in a process of its own (judging a release imports the torch
    modules its patches name: dynamo, inductor, distributed... never into the test process)."""
    taken: dict[str, census.Census] = {}

    def of(version: str) -> census.Census:
        if version not in taken:
            done = npu_shadow("census", wheel(version), "--format", "json", timeout=300)
            assert done.returncode == 0, done.stderr
            found = json.loads(done.stdout)
            patches = tuple(census.Patch(**patch) for patch in found["patches"])
            taken[version] = census.Census(found["source"], found["version"], patches)
        return taken[version]

    return of


@pytest.mark.slow
@pytest.mark.parametrize("version", RELEASES)
def test_each_release_with_the_patches_shows_them_shadowed(releases, version):
    found = {p.name: p for p in releases(version).patches}
    expected = {
        "torch.Tensor.type": "tensor_type",
        "torch.nn.parallel.DataParallel.parallel_apply": "parallel_apply",
        "torch.nn.parallel.data_parallel": "data_parallel",
    }
    for name, target in expected.items():
        assert found[name].applied == "import" and found[name].shadowed_by == target, found.get(name)
    assert found["torch.nn.Module.to"].applied == "import"


@pytest.mark.slow
@pytest.mark.parametrize("version", LATER_RELEASES)
def test_the_later_releases_still_patch_load_to_npu_and_the_dataloader_but_not_the_three(releases, version):
    found = {p.name: p for p in releases(version).patches}
    for name in (
        "torch.load",
        "torch.nn.Module.to",
        "torch.nn.Module.npu",
        "torch.utils.data.dataloader._MultiProcessingDataLoaderIter.__init__",
        "torch.optim.optimizer._get_foreach_kernels_supported_devices",
    ):
        assert found[name].applied == "import", found.get(name)
    assert found["torch.nn.Module.to"].file == "torch_npu/utils/_module.py"
    gone = ("torch.nn.parallel.data_parallel", "torch.nn.parallel.DataParallel.parallel_apply", "torch.Tensor.type")
    assert not set(gone) & set(found)


@pytest.mark.slow
def test_the_command_gives_json_and_names_what_2_13_removed():
    done = npu_shadow("census", wheel("2.13.0"), "--against", wheel("2.12.0"), "--format", "json", timeout=300)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["version"] == "2.13.0" and answer["against"]["version"] == "2.12.0"
    names = {p["name"] for p in answer["patches"]}
    assert {"torch.load", "torch.nn.Module.to", "torch.nn.Module.npu"} <= names
    assert "torch.nn.parallel.data_parallel" not in names
    removed = set(answer["against"]["removed"])
    assert {
        "torch.nn.parallel.data_parallel",
        "torch.nn.parallel.DataParallel.parallel_apply",
        "torch.Tensor.type",
        "torch.nn.modules.rnn.LSTM.forward",
    } <= removed


@pytest.mark.slow
def test_the_command_refuses_a_source_it_cannot_read(tmp_path):
    done = npu_shadow("census", str(tmp_path / "missing.whl"))
    assert done.returncode == 2 and "npu-shadow census:" in done.stderr and "Traceback" not in done.stderr


# --------------------------------------------------------------------------- hostile sources: refused, never followed


def _release(tmp_path, extra: dict[str, bytes] | None = None):
    """A minimal release directory (torch_npu/__init__.py patching torch.load) with ``extra`` files, each imported by
    its ``__init__`` (census reads the modules an import reaches)."""
    root = tmp_path / "release"
    (root / "torch_npu" / "utils").mkdir(parents=True)
    imports = "".join(
        f"import {m.removesuffix('.py').removesuffix('/__init__').replace('/', '.')}\n" for m in extra or {}
    )
    init = f"import torch\n{imports}\n\ndef load(f):\n    return f\n\n\ntorch.load = load\n"
    (root / "torch_npu" / "__init__.py").write_text(init)
    for member, data in (extra or {}).items():
        (root / member).write_bytes(data)
    return root


def _census(source, timeout: float = 60) -> subprocess.CompletedProcess:
    return npu_shadow("census", str(source), timeout=timeout)


def _refused(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith("npu-shadow census:") and "Traceback" not in done.stderr
    assert all(word in done.stderr for word in words), done.stderr


def test_a_python_file_linked_out_of_the_source_is_never_followed(tmp_path):
    outside = tmp_path / "outside.py"
    outside.write_text("import torch\n\ntorch.save = None\n")
    root = _release(tmp_path)
    (root / "torch_npu" / "utils" / "evil.py").symlink_to(outside)
    names = {p.name for p in census.take(str(root)).patches}
    assert names == {"torch.load"}


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_fifo_or_a_device_in_the_source_is_never_opened(tmp_path, kind):
    root = _release(tmp_path)
    special = root / "torch_npu" / "utils" / "special.py"
    if kind == "fifo":
        os.mkfifo(special)
    else:
        special.symlink_to("/dev/zero")
    assert {p.name for p in census.take(str(root)).patches} == {"torch.load"}  # (never read: no hang, no memory)
    with pytest.raises(LegacySourceError, match="not a regular file"):
        ReleaseFiles(root).read("torch_npu/utils/special.py")


@pytest.mark.slow
def test_a_wheel_member_that_inflates_past_the_bound_is_refused_at_once(tmp_path):
    wheel = tmp_path / "torch_npu-9.9.9-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as out:
        out.writestr("torch_npu/__init__.py", "import torch\n")
        out.writestr("torch_npu/utils/__init__.py", "")
        out.writestr("torch_npu/big.py", b"#" * (MAX_MEMBER_BYTES + 10))
    _refused(_census(wheel, timeout=120), "torch_npu/big.py", "larger than")  # (a 2 GiB one ran past 300 s)


@pytest.mark.slow
@pytest.mark.parametrize(
    "data, words",
    [
        (b"x = '\xff\xfe'\n", ("not text in UTF-8",)),
        ("x = 1\n".encode("utf-16"), ("not text in UTF-8",)),
        (("x = " + "+".join(["a"] * 300_000) + "\n").encode(), ("nested deeper than",)),
    ],
    ids=["latin-1", "utf-16", "long-expression"],
)
def test_a_file_census_cannot_read_is_a_clear_refusal(tmp_path, data, words):
    _refused(_census(_release(tmp_path, {"torch_npu/odd.py": data})), "torch_npu/odd.py", *words)


def test_a_declared_encoding_is_read_as_declared(tmp_path):
    declared = "# -*- coding: latin-1 -*-\nimport torch\n\ntorch.save = 'caf\xe9'\n".encode("latin-1")
    root = _release(tmp_path, {"torch_npu/utils/__init__.py": declared})
    assert {p.name for p in census.take(str(root)).patches} == {"torch.load", "torch.save"}


@pytest.mark.slow
def test_a_call_chain_deeper_than_census_follows_is_a_clear_refusal(tmp_path):
    chain = "\n".join(f"def f{i}():\n    f{i + 1}()\n" for i in range(3000)) + "\ndef f3000():\n    pass\n\nf0()\n"
    _refused(_census(_release(tmp_path, {"torch_npu/utils/__init__.py": chain.encode()})), "chained deeper than")


@pytest.mark.slow
def test_control_characters_in_names_are_printed_escaped(tmp_path):
    root = _release(tmp_path)
    (root / "torch_npu" / "__init__.py").write_text("import torch\n\nsetattr(torch, '\\x1b[31mred', None)\n")
    done = _census(root)
    assert done.returncode == 0 and "\x1b" not in done.stdout and "\\x1b[31mred" in done.stdout


def _wheel(path, package: dict[str, str]):
    with zipfile.ZipFile(path, "w") as out:
        for member, text in package.items():
            out.writestr(member, textwrap.dedent(text))
    return path


@pytest.mark.slow
def test_a_census_is_taken_once_per_wheel_and_read_back_without_torch(tmp_path, monkeypatch):
    """``census 2.13.0 --against 2.12.0`` took 280 s at load 11-14 (25 s of CPU, every time): a wheel's census is now
    kept beside the wheels and read back (no parsing, no torch); a wheel that changed, or a kept census that cannot be
    read, is taken again."""
    monkeypatch.setenv("NPU_SHADOW_CACHE_DIR", str(tmp_path / "cache"))
    wheel = _wheel(tmp_path / "torch_npu-9.9.9-py3-none-any.whl", PACKAGE)
    taken = census_cache.kept(str(wheel))
    assert taken == census.take(str(wheel)) and "torch.nn.Module.to" in taken.names()
    (place,) = (tmp_path / "cache" / "census").glob("*.census.json")
    reads_back = (
        "import sys\nfrom shadow.analysis import census_cache\n"
        f"print(len(census_cache.kept({str(wheel)!r}).patches), 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", reads_back], capture_output=True, text=True, env=dict(os.environ))
    assert done.stdout.split() == [str(len(taken.patches)), "False"], done.stderr
    place.write_text("{not json")
    assert census_cache.kept(str(wheel)) == taken  # (unreadable: taken again)
    changed = {**PACKAGE, "torch_npu/utils/_module.py": PACKAGE["torch_npu/utils/_module.py"] + "\n\n# changed\n"}
    changed["torch_npu/utils/_module.py"] = changed["torch_npu/utils/_module.py"].replace("nn.Module.to = to", "pass")
    os.utime(_wheel(wheel, changed), ns=(1, 1))
    assert "torch.nn.Module.to" not in census_cache.kept(str(wheel)).names()


def _returns_within(seconds: float, function, *args):
    """``function(*args)``, failing the test where it has not returned within ``seconds`` (a FIFO waited on)."""
    import threading

    found: list = []
    worker = threading.Thread(target=lambda: found.append(function(*args)), daemon=True)
    worker.start()
    worker.join(seconds)
    assert found, f"{function.__name__} still blocked after {seconds} s"
    return found[0]


def test_the_census_cache_is_data_checked_against_its_wheel(tmp_path, monkeypatch):
    """A kept patch list is used only where it is a regular file of this user's that no one else can write and names
    the digest of the wheel it came from; anything else (a planted name in a file others could write, another wheel's
    list, a FIFO) is never trusted or waited on: the list is taken again."""
    import stat

    monkeypatch.setenv("NPU_SHADOW_CACHE_DIR", str(tmp_path / "cache"))
    wheel = _wheel(tmp_path / "torch_npu-9.9.9-py3-none-any.whl", PACKAGE)
    listed = census_cache.patch_list(str(wheel))
    honest = json.loads(listed.read_text())
    assert stat.S_IMODE(listed.parent.stat().st_mode) == 0o700 and "wheel_sha256" in honest
    planted = {**honest, "patches": [*honest["patches"], "builtins.print"]}

    listed.write_text(json.dumps(planted))
    os.chmod(listed, 0o666)  # (others could have written it)
    assert json.loads(census_cache.patch_list(str(wheel)).read_text()) == honest

    listed.write_text(json.dumps({**planted, "wheel_sha256": "0" * 64}))  # (another wheel's list)
    assert json.loads(census_cache.patch_list(str(wheel)).read_text()) == honest

    for kept in (listed, *listed.parent.glob("*.census.json")):
        kept.unlink()
        os.mkfifo(kept)
    again = _returns_within(30, census_cache.patch_list, str(wheel))
    assert again.is_file() and json.loads(again.read_text()) == honest


def test_a_census_cache_others_can_write_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("NPU_SHADOW_CACHE_DIR", str(tmp_path / "cache"))
    wheel = _wheel(tmp_path / "torch_npu-9.9.9-py3-none-any.whl", PACKAGE)
    folder = census_cache.patch_list(str(wheel)).parent
    os.chmod(folder, 0o777)
    with pytest.raises(census_cache.UnsafeCache, match=re.escape(str(folder))):
        census_cache.patch_list(str(wheel))


@pytest.mark.slow
def test_the_launcher_refuses_a_census_cache_others_can_write_at_start_up(tmp_path):
    """Before the job starts: exit 2, the path named (the job never runs unshadowed, nor with a planted list)."""
    import shutil

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    shutil.copy(wheel("2.14.0"), wheels)
    (tmp_path / "census").mkdir(mode=0o777)
    os.chmod(tmp_path / "census", 0o777)
    done = npu_shadow(
        "run",
        "--legacy-from",
        "2.14.0",
        "--",
        sys.executable,
        "-c",
        "print('ran')",
        env={**os.environ, "NPU_SHADOW_WHEEL_DIR": str(wheels)},
        timeout=300,
    )
    assert done.returncode == 2 and "ran" not in done.stdout, done.stdout + done.stderr
    assert str(tmp_path / "census") in done.stderr and "writable by others" in done.stderr


def test_a_job_process_never_waits_on_a_fifo_named_as_its_patch_list(tmp_path, capsys):
    from shadow.launcher import launch

    fifo = tmp_path / "list.json"
    os.mkfifo(fifo)
    assert _returns_within(30, launch._patch_list, {launch.PATCH_LIST: str(fifo)}) == ((), "", 0)
    assert "no patch calls counted" in capsys.readouterr().err
