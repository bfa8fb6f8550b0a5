"""`python -m sparkpoint.cli`: the `sparkpoint` command."""

import sys

from sparkpoint.cli import main

sys.exit(main())
