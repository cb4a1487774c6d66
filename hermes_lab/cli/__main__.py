"""`python -m hermes_lab.cli ...`: the same as `hermes-lab ...` (hermes_lab.cli.main)."""

import sys

from hermes_lab.cli.main import main

sys.exit(main())
