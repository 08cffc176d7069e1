"""Adapters that end badly inside a warm worker (streambp_conform.warm), for cli_conform_warm.sh: MODE hang (sleeps
until conform's --timeout kills its process group; its pid goes to the file $CONFORM_FAULTY_PID_FILE) or kill (dies
of SIGKILL, which conform must report as the adapter's own death).

Usage: PYTHON conform_warm_faults.py MODE CASE_DIR
"""
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "verify" / "conform"))
from streambp_conform.warm import delegate, in_worker  # noqa: E402

delegate()
if not in_worker():
    sys.exit("conform_warm_faults.py: not in a warm worker (STREAMBP_CONFORM_WARM names no server)")
if sys.argv[1] == "hang":
    Path(os.environ["CONFORM_FAULTY_PID_FILE"]).write_text(str(os.getpid()))
    time.sleep(3600)
os.kill(os.getpid(), signal.SIGKILL)
