"""The sample project's CI test: each conform case of the `ci` set a pytest item (the streambp_conform plugin; the
harness binary from --streambp or STREAMBP)."""
import sys
from pathlib import Path

import pytest

ADAPTER = [sys.executable, str(Path(__file__).resolve().parent / "adapter.py")]
CASES = dict(cases="ci", objectives=["sft"], dtypes=["fp64"])


@pytest.mark.streambp_conform(adapter=ADAPTER, **CASES)
def test_chunked_loss():
    """The right loss: every fp64 SFT case of the ci set within 1e-10 of the harness's oracle."""


@pytest.mark.streambp_conform(adapter=ADAPTER + ["--wrong"], **CASES)
def test_chunked_loss_wrong():
    """The chunk-means loss: conform must fail it, naming the tensor (run with -k wrong)."""
