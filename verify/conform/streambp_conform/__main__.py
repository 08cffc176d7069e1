"""python -m streambp_conform serve SOCKET [MODULE ...]: the warm-start server (streambp_conform/warm.py)."""
import sys

from streambp_conform.warm import main

sys.exit(main())
