"""`python -m autoconfig ...`, the same as `strata autoconfig ...`."""

import sys

from autoconfig.cli import main

sys.exit(main())
