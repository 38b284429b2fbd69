"""Running jobs shadowed: the ``npu-shadow`` command (``cli``), its settings (``config``), the process that
starts the job (``runner``), the bootstrap that arms every process of the job (``bootstrap``, ``launch``) and
``doctor``."""
