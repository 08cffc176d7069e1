"""Known GRPO trainer bugs (issue #60), planted in TRL's GRPOTrainer through streambp_conform.trl_grpo.Hooks, for the
negative controls of the RL step oracle: tests/oracle/rl_step_parity.py (STREAMBP_RL_TRL_BUG) and `streambp conform
--cases rl` (tests/support/conform_rl_faults.py, tests/cli/cli_conform_rl.sh). Each is what a trainer gets wrong
between its completions and its optimizer; none is in TRL's or the oracle's code.

  pads        the prompts' left pads attended (the prompt mask all ones): every log-prob moves
  eos         the EOS mask off by one: each completion's EOS left unscored
  advantages  advantages normalised over the wrong set: the group-normalised ones again over the whole batch
  normaliser  dapo's normaliser taken per micro-batch (its own completion tokens) instead of the generation batch's
  old_logps   old_logps from the wrong pass: the current weights' (detached) instead of generation time's
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "verify" / "conform"))
from streambp_conform.trl_grpo import Hooks  # noqa: E402

NAMES = ("pads", "eos", "advantages", "normaliser", "old_logps")


def _eos_unscored(eos):
    def scored(out, trainer):
        mask = out["completion_mask"]
        last = mask.sum(1) - 1  # the kept completion's last token: its EOS, unless truncated
        ends = out["completion_ids"].gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1) == eos
        rows = (ends & (last >= 0)).nonzero().flatten()
        mask[rows, last[rows]] = 0
        return out
    return scored


def _advantages_over_batch(out, trainer):
    a = out["advantages"]
    out["advantages"] = (a - a.mean()) / (a.std() + 1e-4)
    return out


def _pads_attended(out, trainer):
    import torch

    out["prompt_mask"] = torch.ones_like(out["prompt_mask"])
    return out


def _normaliser_per_micro_batch(inputs, trainer):
    # dapo divides by num_items_in_batch x accumulation / steps_per_generation: this micro-batch's own tokens instead
    return dict(inputs, num_items_in_batch=inputs["completion_mask"].sum() * trainer.args.steps_per_generation)


def _old_logps_current(inputs, trainer):
    return {k: v for k, v in inputs.items() if k != "old_per_token_logps"}


def hooks(name, eos):
    """The Hooks that plant bug `name` (NAMES) in a run whose EOS token is `eos`; ValueError naming the known ones."""
    if name not in NAMES:
        raise ValueError(f"unknown trainer bug {name!r} ({', '.join(NAMES)})")
    return {"pads": Hooks(scored=_pads_attended), "eos": Hooks(scored=_eos_unscored(eos)),
            "advantages": Hooks(scored=_advantages_over_batch),
            "normaliser": Hooks(loss_inputs=_normaliser_per_micro_batch),
            "old_logps": Hooks(loss_inputs=_old_logps_current)}[name]
