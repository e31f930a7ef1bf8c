"""``python -m benchmarks.predict``."""

import sys

from benchmarks.predict.cli import main

sys.exit(main())
