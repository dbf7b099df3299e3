"""`python -m strata_desk` = the `strata-desk` command."""

import sys

from strata_desk.cli import main

sys.exit(main())
