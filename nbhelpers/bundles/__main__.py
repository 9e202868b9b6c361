"""``python -m nbhelpers.bundles build|verify|resplit ...`` (see :mod:`nbhelpers.bundles.cli`)."""

import sys

from nbhelpers.bundles.cli import main

sys.exit(main())
