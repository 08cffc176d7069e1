#!/usr/bin/env python3
"""streambp_official.py with the official StreamBP's SFT normalisation fixed by a minimal monkeypatch of the one function
that holds it, streambp.stream_model.StreamModel.forward (src/streambp/stream_model.py:548-688 at commit 3b56c16).

The patch takes that function's own source from the installed package (inspect.getsource), replaces exactly these
lines (each must occur exactly once, else the patch refuses to run), recompiles it in the module's namespace and
assigns it back; nothing else of the package changes:

  line 633  chunk_valid_posnum = (labels_chunk != -100).sum().item() - batch_size # remove the last token per batch
        ->  chunk_valid_posnum = (labels_chunk[:, 1:] != -100).sum().item()
      The chunk's targets under HF's shift inside model.loss_function are labels_chunk[:, 1:] (logits position t
      predicts label t + 1; the chunk's logits overlap the next chunk by one position, line 627). Subtracting B
      assumes every row's label at the chunk's first position is a target; a masked prompt or padding there
      makes the weight too small (and can skip a chunk altogether, `if chunk_valid_posnum <= 0: continue`).
  line 657  batch_valid_posnum = (labels != -100).sum().item()
        ->  batch_valid_posnum = (labels[:, 1:] != -100).sum().item()
      The divisor of the loss (line 658) and, through _valid_pos_num, of every gradient (line 675) must be the
      batch's number of shifted targets (HF's num_items_in_batch), not of unshifted labels: labels[:, 0] is never a
      target, so each row whose first label is not -100 adds one too many.
  line 617  loss = torch.tensor(0., device=hidden_states.device)
        ->  loss = torch.tensor(0., device=hidden_states.device, dtype=hidden_states.dtype)
      (precision only, for the fp64 loss check: the accumulator is fp32 whatever the model dtype, so the reported
      fp64 loss is rounded to fp32, ~1e-8 relative; gradients are unaffected.) STREAMBP_FIX_LOSS_DTYPE=0 leaves it.

Usage: streambp_official_fixed.py CASE_DIR
"""
import inspect
import os
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import streambp.stream_model as sm  # noqa: E402

FIXES = [
    ("chunk_valid_posnum = (labels_chunk != -100).sum().item() - batch_size",
     "chunk_valid_posnum = (labels_chunk[:, 1:] != -100).sum().item()"),
    ("batch_valid_posnum = (labels != -100).sum().item()",
     "batch_valid_posnum = (labels[:, 1:] != -100).sum().item()"),
]
if os.environ.get("STREAMBP_FIX_LOSS_DTYPE", "1") == "1":
    FIXES.append(("loss = torch.tensor(0., device=hidden_states.device)",
                  "loss = torch.tensor(0., device=hidden_states.device, dtype=hidden_states.dtype)"))


# GRPO (not part of the SFT fix; precision only, STREAMBP_FIX_LOSS_DTYPE=0 leaves it): the same fp32 loss accumulator in
# StreamGRPOTrainer._compute_loss, src/streambp/trainers/stream_grpo_trainer.py:135. Its gradients are exact as shipped.
GRPO_FIXES = [("loss = torch.tensor(0., device=model.device)",
               "loss = torch.tensor(0., device=model.device, dtype=detached_hidden_states.dtype)")] \
    if os.environ.get("STREAMBP_FIX_LOSS_DTYPE", "1") == "1" else []


def patch_function(module, cls, name, fixes):
    """Recompile cls.<name> from its own installed source with each (old, new) line replaced exactly once."""
    src = textwrap.dedent(inspect.getsource(getattr(cls, name)))
    for old, new in fixes:
        if src.count(old) != 1:
            raise RuntimeError(f"{cls.__name__}.{name}: expected exactly one {old!r}, found {src.count(old)}")
        src = src.replace(old, new)
    namespace = {}
    exec(compile(src, f"<patched {module.__file__}:{cls.__name__}.{name}>", "exec"), module.__dict__, namespace)
    setattr(cls, name, namespace[name])


patch_function(sm, sm.StreamModel, "forward", FIXES)
if GRPO_FIXES:
    import streambp.trainers.stream_grpo_trainer as sg  # noqa: E402

    patch_function(sg, sg.StreamGRPOTrainer, "_compute_loss", GRPO_FIXES)

import streambp_official  # noqa: E402

if __name__ == "__main__":
    sys.exit(streambp_official.run(sys.argv[1:]))
