"""The learner: buffer, PPO/GRPO, weights out, logs and checkpoints.

Importing the package adds ``algorithm.cfg.correction``'s rule to the config loader
(``learner/corrections.py``: the mode's default correction, the registry's names), so every process
and tool that trains resolves the same correction from the same config, whichever module it loads first.
"""

from learner import corrections as _corrections  # noqa: F401  (registers the correction's config rule)
