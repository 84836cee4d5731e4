"""Soak run: 10^4 calls of every op family cycling through varied shapes in one virtual world,
every result checked, memory recorded per cycle (``ditron_ops.testing.soak``; its docstring has
the details and the exit statuses).

    python tools/soak.py --out /tmp/soak                       # H200: W = 4, bf16, 10^4 calls
    python tools/soak.py --calls 40 --world-size 2 --out /tmp/soak   # CPU smoke run (tiny shapes)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ditron_ops.testing.soak import main  # noqa: E402  (after the path)

if __name__ == "__main__":
    sys.exit(main())
