"""``python -m nbhelpers.bundles build|verify|resplit ...`` (see :mod:`nbhelpers.bundles.build`)."""

import sys

from nbhelpers.bundles.build import main

sys.exit(main())
