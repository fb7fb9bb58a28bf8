"""Every TensorDict key Tandem uses, spelled once.

Rollouts are flat, batch-first ``[N, T]`` TensorDicts (N envs x T steps). We do not use
TorchRL's ``("next", ...)`` sub-TensorDict: the only "next" quantity the learner needs is the
value of the true state after each step, which the actor computes and sends as ``NEXT_VALUE``
(see ``actors/rollout.py``). The one place that talks to TorchRL (the GAE reference test)
converts there.
"""

OBS = "observation"             # tensor, or a nested TensorDict for multi-modal input
ACTION = "action"               # as sampled by the policy (unclipped for Box spaces)
LOG_PROB = "sample_log_prob"    # log-prob of ACTION under the policy that acted
VALUE = "value"                 # V(OBS) under the policy that acted
NEXT_VALUE = "next_value"       # V(true state after the step): the final observation on
                                # truncation, never the auto-reset observation
REWARD = "reward"
TERMINATED = "terminated"       # the MDP ended: no bootstrap
TRUNCATED = "truncated"         # cut by a time limit: bootstrap from NEXT_VALUE
DONE = "done"                   # terminated | truncated: GAE recursion stops here
POLICY_VERSION = "policy_version"  # int64, the weight version that chose ACTION
EXECUTED = "executed_actions"   # int64, action-chunk policies only: how many of the call's H actions
                                # the envs executed (1..actions_per_call; fewer where an episode ended
                                # mid-chunk). One row is one policy call (a macro step): REWARD is the
                                # executed steps' rewards discounted within the chunk, LOG_PROB covers
                                # the executed actions only, and the learner discounts the row by
                                # gamma ** EXECUTED (shared/chunks.py)
BOOTSTRAP_OBS = "bootstrap_observation"  # vla-mode PPO only (shared.rollout.sends_bootstrap_obs):
                                # the true observation after step t where it is not OBS[t + 1]
                                # (the final observation of a truncated step, and the observation
                                # after the rollout's last step), zeros elsewhere. The learner
                                # recomputes every bootstrap value from it with its current critic.

# Learner-side, added to sampled batches (never sent by actors)
ADVANTAGE = "advantage"
VALUE_TARGET = "value_target"
MASK = "update_mask"            # bool: which steps take part in the update (GRPO, a correction that drops samples)

# Per-rollout episode statistics travel in the message meta (they are not [N, T]-shaped).
META_EPISODE_RETURNS = "episode_returns"
META_EPISODE_LENGTHS = "episode_lengths"

ROLLOUT_STEP_KEYS = (ACTION, LOG_PROB, VALUE, NEXT_VALUE, REWARD, TERMINATED, TRUNCATED, DONE,
                     POLICY_VERSION)

# Flow-matching chunk policies (shared/policies/flow_policy.py): what the learner needs to recompute a
# chunk's log-likelihood exactly, declared by the policy's rollout_extras() and copied into every row.
FLOW_CHAIN = "flow_chain"       # float32 [K+1, H, max_action_dim]: the denoising chain x_1 (noise) .. x_0
FLOW_STEP = "flow_sde_step"     # int64: Flow-SDE's stochastic step k* (0..K-1) of the row's call
