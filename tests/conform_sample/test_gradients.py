import sys

import pytest


@pytest.mark.streambp_conform(adapter=[sys.executable, "adapter.py"], cases="ci", objectives=["sft"])
def test_my_loss():
    pass
