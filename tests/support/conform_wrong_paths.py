"""Training-path bugs `streambp conform` must catch (issue #45), on HF like verify/conform/hf_adapter.py. MODE:
  micro-means     each micro-batch normalised by its own target count, the K losses averaged (a mean of micro-batch
                  means): fails the micro-batch cases, passes them under `--accumulation micro-means`;
  drop-tied-head  the lm_head untied from the embedding before the step, so the tied tensor's gradient lacks the
                  head's use: fails the tied cases, passes the untied ones;
  skip-last       the step's last micro-batch never back-propagated (its gradient missing), all K reported;
  uncounted       right gradients, but result.json without "micro_batches".
Usage: PYTHON conform_wrong_paths.py MODE CASE_DIR
"""
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "verify" / "conform"))
from streambp_conform.warm import delegate  # noqa: E402

delegate()  # in a warm worker when STREAMBP_CONFORM_WARM names a server (streambp_conform/warm.py)
import torch  # noqa: E402

import losses  # noqa: E402
import protocol  # noqa: E402

mode, case_dir = sys.argv[1], sys.argv[2]
try:
    case = protocol.read_case(case_dir, accumulates=True)
    model, trainable = protocol.load_model(case)
except protocol.CaseError as e:
    sys.exit(f"{case_dir}: {e}")
parts = len(case.micro_batches or [None])
loss_fn, run = losses.loss, case
if mode == "micro-means":
    loss_fn = lambda m, part: losses.loss(m, replace(part, union=None)) / parts  # noqa: E731
elif mode == "drop-tied-head" and model.config.tie_word_embeddings:
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
elif mode == "skip-last" and case.micro_batches:
    run = replace(case, micro_batches=case.micro_batches[:-1])
elif mode not in ("drop-tied-head", "skip-last", "uncounted"):
    sys.exit(f"unknown mode {mode}")
loss, grads, seconds = protocol.run_step(run, model, trainable, loss_fn)
counted = case.micro_batches and mode != "uncounted"
protocol.write_outputs(case, loss, grads, seconds, parts if counted else None)
