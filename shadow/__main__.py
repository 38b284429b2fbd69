import sys

from shadow.launcher.cli import main

sys.exit(main())
