"""`python -m stowage.engine.cli`: how the app and the CLI start the engine in a child process."""

import os
import sys

from . import main

status = main()
# By now the command has finished its work (a served model is freed, its conversations written to the KV store, its
# socket removed); unloading the interpreter's modules one by one (torch's thousands) would add a third of a second
# to every engine child's stop, which the app and `stowage generate` wait for.
sys.stdout.flush()
sys.stderr.flush()
os._exit(status if isinstance(status, int) else 1)
