"""`python -m hermes_lab.prep --input ... --output ...`: the user's command (docs/SPEC.md).

The prep stage lives in ``hermes_lab.prep.run``; this module keeps the command the user types.
"""

import sys

from hermes_lab.prep.run import main

if __name__ == "__main__":
    sys.exit(main())
