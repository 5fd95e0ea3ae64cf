"""``python -m mode ...`` (and ``torchrun ... -m mode train ...``): the ``mode`` command line."""

import sys

from mode.cli import main

sys.exit(main())
