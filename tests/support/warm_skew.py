"""A module for the warm server to preload that leaks state into every worker, as a careless preload would
(cli_conform_warm.sh's negative control): HF's cross-entropy scaled by 1 + 1e-6, so a worker's fp64 SFT gradients
differ from a cold process's by 1e-6."""
import transformers.loss.loss_utils as loss_utils

_fixed_cross_entropy = loss_utils.fixed_cross_entropy


def _skewed(*args, **kwargs):
    return _fixed_cross_entropy(*args, **kwargs) * (1 + 1e-6)


loss_utils.fixed_cross_entropy = _skewed
