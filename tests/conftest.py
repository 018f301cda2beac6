import sys
from pathlib import Path

import torch

# tests/support/factory.py builds the tiny models every test package uses.
sys.path.insert(0, str(Path(__file__).parent / "support"))
# Tiny models: one thread is faster than two (no fork/join per op) and immune to a busy machine.
torch.set_num_threads(1)
