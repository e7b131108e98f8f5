"""One OPD step in data-flow order: rollout -> scoring -> objective -> trainer (with evaluate
and the loop state)."""
