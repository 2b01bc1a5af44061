"""The RL algorithm as pure functions over tensors, each piece chosen by a Hydra config group
and composed by `objective.Objective`; the trainer (rlexp/trainer/) runs it and knows no
algorithm.

    advantage    rewards -> per-token advantages        (conf/advantage: grpo, dr_grpo, rloo, ...)
    policy_loss  logprobs, advantages -> per-token loss  (conf/policy_loss: ppo_clip, gspo, cispo, ...)
    mismatch     rollout vs trainer logprobs -> weights and masks (conf/mismatch: token_tis, icepop, ...)
    kl           policy vs reference -> a loss term or a reward penalty (conf/kl: k1, k2, k3, low_var_kl)
    aggregation  per-token loss -> the minibatch's scalar (conf/aggregation: token_mean, ...)

Two files hold a GRPO update's formulas: advantages.py (the advantages) and objective.py (the
per-token loss: ratios, policy losses, KL, aggregation and their composition). gae.py adds
PPO's GAE and value loss; mismatch.py the rollout/trainer mismatch corrections, and the two
policy losses built on them (`tis`, `decoupled`).

Every tensor of a micro-batch is [rows, T] and aligned to the predicted tokens; `mask` is 1.0
where a token is trained. Every `exp` of a log-ratio goes through `objective.clamped_exp`."""
