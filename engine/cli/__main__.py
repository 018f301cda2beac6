"""`python -m stowage.engine.cli`: how the app and the CLI start the engine in a child process."""

import sys

from . import main

sys.exit(main())
