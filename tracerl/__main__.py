"""``python -m tracerl``: the command line (:mod:`tracerl.cli`)."""

import sys

from .cli import main

sys.exit(main())
