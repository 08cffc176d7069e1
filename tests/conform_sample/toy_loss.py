"""A user's chunked causal-LM loss (the sample project of docs/conform-in-ci.md): the LM head and cross-entropy over
`chunk` positions at a time, so that the [B, T, V] logits never exist at once."""
import torch.nn.functional as F


def chunked_cross_entropy(hidden, weight, targets, chunk):
    """hidden: [B, T, d]; weight: [V, d]; targets: [B, T] (-100: not a target). Each chunk's summed token losses,
    divided once by the batch's target count: the mean over the batch's targets, as unchunked."""
    total = hidden.new_zeros(())
    for start in range(0, hidden.size(1), chunk):
        logits = hidden[:, start:start + chunk] @ weight.T  # [B, c, V]
        total = total + F.cross_entropy(logits.flatten(0, 1), targets[:, start:start + chunk].flatten(),
                                        ignore_index=-100, reduction="sum")
    return total / (targets != -100).sum()


def chunked_cross_entropy_wrong(hidden, weight, targets, chunk):
    """The classic bug: each chunk's own mean, averaged over the chunks; right only when every chunk holds as many
    targets as the others."""
    means = []
    for start in range(0, hidden.size(1), chunk):
        t = targets[:, start:start + chunk]
        if (t != -100).any():
            logits = hidden[:, start:start + chunk] @ weight.T  # [B, c, V]
            means.append(F.cross_entropy(logits.flatten(0, 1), t.flatten(), ignore_index=-100))
    return sum(means) / len(means)
