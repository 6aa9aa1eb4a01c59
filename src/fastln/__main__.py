"""`python -m fastln ...`, the same as the `fastln` command."""
import sys

from fastln.cli import main

sys.exit(main())
