"""``python -m lens_evals.cli``: the ``lens-evals`` command."""

import sys

from lens_evals.cli.app import main

sys.exit(main())
