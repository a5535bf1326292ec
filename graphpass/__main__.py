"""``python -m graphpass`` is the ``graphpass`` command."""

import sys

from .cli import main

sys.exit(main())
