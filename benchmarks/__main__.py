"""``python -m benchmarks`` from the repository root."""

import sys

from benchmarks.main import main

sys.exit(main())
