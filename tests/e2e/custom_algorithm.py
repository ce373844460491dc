"""An advantage estimator and a policy loss from outside rlsys, for ``test_modes.py``: the config names them
(``algorithm.advantage.estimator: custom_algorithm:centered``, ``algorithm.loss.policy_loss:
custom_algorithm:unclipped``) and ``rlsys.config.registry`` imports them where they run."""

import torch

from rlsys.algorithms import aggregate, broadcast_to_tokens


def centered(x, cfg):
    """Each sample's score minus its prompt's mean score (Dr. GRPO without the std), on every response token."""
    ids = torch.tensor([hash(g) for g in x.group_ids])
    _, index = torch.unique(ids, return_inverse=True)
    scores = x.scores.float()
    sums = torch.zeros(int(index.max()) + 1).index_add_(0, index, scores)
    counts = torch.zeros(int(index.max()) + 1).index_add_(0, index, torch.ones_like(scores))
    adv = scores - (sums / counts)[index]
    return broadcast_to_tokens(adv, x.mask), None, {"advantage/custom_calls": 1.0}


centered.groups = True  # it compares the samples of one prompt: the rules ask for rollout.sampling.n >= 2


def unclipped(logp, old_logp, advantages, mask, cfg, *, weights=None, **denominators):
    """The importance-weighted policy gradient without PPO's clip."""
    loss = -advantages * torch.exp(logp - old_logp)
    loss = loss * weights if weights is not None else loss
    pg_loss = aggregate(loss, mask, cfg.agg_mode, **denominators)
    return pg_loss, {"pg_loss": pg_loss.detach(), "custom_marker": torch.tensor(1.0)}


unclipped.metrics = {"custom_marker": "mean"}  # reduced over micro-batches and DP ranks as a token mean
