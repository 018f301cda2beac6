"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter.

triton.jit reads TRITON_INTERPRET when a kernel is decorated, i.e. when kernels.triton_* is first
imported. `import kernels` never imports triton (attention_ops does, lazily, and only for CUDA), so
setting the variable here, at collection, is early enough even after other test packages have
imported torch, engine and kernels. test_interpreter_is_active checks that it took effect.
The compiled kernels are exercised by test_gpu.py in a subprocess without this variable.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

# --import-mode=importlib puts no test folder on sys.path; the tests import paged_cases from here.
sys.path.insert(0, str(Path(__file__).parent))
