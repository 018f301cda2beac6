import sys
from pathlib import Path

# tests/support/factory.py builds the tiny models every test package uses.
sys.path.insert(0, str(Path(__file__).parent / "support"))
