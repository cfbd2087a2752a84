"""``python -m steadydiff`` (and ``torchrun ... -m steadydiff train CONFIG``)."""

import sys

from .cli import main

sys.exit(main())
