"""``python -m app.check``: see ``app/check/__init__.py``."""

import sys

from app.check.cli import main

sys.exit(main())
