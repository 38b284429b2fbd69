"""torch_npu's own ``testing/decorator.py`` (``Dtypes``, ``Formats``, ``instantiate_tests``), run from the release's
wheel: it uses torch and the standard library only."""

import os
import zipfile

with zipfile.ZipFile(os.environ["TORCH_NPU_TESTS_WHEEL"]) as _wheel:
    exec(compile(_wheel.read("torch_npu/testing/decorator.py"), "torch_npu/testing/decorator.py", "exec"))
