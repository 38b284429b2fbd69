import sys

from shadow.cli import main

sys.exit(main())
