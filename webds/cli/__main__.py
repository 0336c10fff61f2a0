"""``python -m webds.cli ...`` runs the ``webds`` command."""

import sys

from . import main

sys.exit(main())
