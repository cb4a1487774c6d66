"""`python -m hermes_lab.ab_run --baseline ... --candidate ... --ratio 0.1 --duration 7200 --output ...`: the
user's command (docs/SPEC.md).

The A/B stage lives in ``hermes_lab.ab.run``; this module keeps the command the user types.
"""

import sys

from hermes_lab.ab.run import main

if __name__ == "__main__":
    sys.exit(main())
