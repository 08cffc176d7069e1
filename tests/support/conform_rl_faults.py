#!/usr/bin/env python3
"""TRL's GRPOTrainer under the conform protocol with one known trainer bug planted (tests/support/rl_trainer_bugs.py):
the survey's adapter (verify/conform/survey/trl_grpo.py) with Hooks, for the negative controls of `streambp conform
--cases rl` (tests/cli/cli_conform_rl.sh). Each bug must fail its case naming the tensor where it shows first.

Usage: conform_rl_faults.py BUG CASE_DIR   (BUG: pads, eos, advantages, normaliser, old_logps)
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "verify" / "conform"))
from streambp_conform.warm import delegate  # noqa: E402

delegate()
sys.path.insert(0, str(HERE.parents[1] / "verify" / "conform" / "survey"))
sys.path.insert(0, str(HERE))
import rl_trainer_bugs  # noqa: E402
import trl_grpo  # noqa: E402  (the survey adapter)
from streambp_conform import protocol  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in rl_trainer_bugs.NAMES:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        sys.exit(2)
    bug = sys.argv[1]
    sys.exit(protocol.run(lambda case: trl_grpo.step(case, rl_trainer_bugs.hooks(bug, case.rl.eos)), sys.argv[2:],
                          rl_steps=True))
