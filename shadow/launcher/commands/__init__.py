"""The ``npu-shadow`` command's commands, one module each: ``add(commands)`` puts its parser among the commands,
``handle(args)`` runs it and gives its exit code; ``options`` holds what they share."""
