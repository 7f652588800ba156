"""`python -m shoal.peer.cli ...` is `shoal ...`."""

import sys

from shoal.peer.cli import main

sys.exit(main())
