"""``python -m app.doctor DIR``: which rank, which collective, and why, from the flight recorder's dumps.

The doctor itself is ``app.diagnostics.doctor``; this module is its command line (docs/diagnostics.md).
"""

import sys

from app.diagnostics.doctor import main

if __name__ == "__main__":
    sys.exit(main())
