"""`python -m flows.cli`: the `traingate` command."""

import sys

from flows.cli import main

sys.exit(main())
