"""``python -m serving --help``: the jobs of this package (``serving.cli``)."""

import sys

from serving.cli import main

sys.exit(main())
