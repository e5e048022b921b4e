"""`python -m ops.native`: build this machine's native kernels (ops/native/__init__.py)."""
import sys

from ops.native import main

sys.exit(main())
