"""`python -m hermes_lab.train --config ... --data ... --output ...`: the user's command (docs/SPEC.md).

The train stage lives in ``hermes_lab.train.grpo``; this file is its entry point under the package's name.
"""

import sys

from hermes_lab.train.grpo import main

sys.exit(main())
