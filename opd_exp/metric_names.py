"""Every metric name opd-exp logs, with what it means: one owner for the names that dashboards,
notebooks and ``opd-compare`` read (docs/training.md, "Metrics", says the same in full).

Writers and readers take the names from here; ``tests/test_metric_names.py`` fails when a module
writes a ``group/name`` literal that is not declared, when a run logs an undeclared key, or when a
declared name is missing from the docs. Names with a ``<...>`` part are families (a teacher's name,
a registered divergence).
"""

from __future__ import annotations

import re

STEP: dict[str, str] = {
    "loss": "the step's loss (sum over tokens / loss.normalizer)",
    "lr": "learning rate of the step",
    "jsd/mean": "unbiased estimate of JSD_beta per token (importance-weighted)",
    "kl/reverse": "unbiased estimate of KL(S||T) per token",
    "kl/forward": "unbiased estimate of KL(T||S) per token",
    "exact/jsd": "JSD_beta exactly over the vocabulary, per token",
    "exact/kl_reverse": "KL(S||T) exactly over the vocabulary, per token",
    "exact/kl_forward": "KL(T||S) exactly over the vocabulary, per token",
    "advantages/mean": "-kl_coef x return (after the baseline), per token",
    "student/logprob_mean": "mean log S(y) of the sampled tokens",
    "teacher/logprob_mean": "mean log T(y) of the sampled tokens",
    "student/entropy": "exact entropy of S",
    "teacher/entropy": "exact entropy of T",
    "overlap/teacher_mass": "the teacher's mass on the student's top-k",
    "overlap/student_mass": "the student's mass on the teacher's top-k",
    "overlap/ratio": "share of the two top-k sets in common",
    "rollout/logprob_gap": "mean |log S_engine(y) - log S_trainer(y)|",
    "rollout/logprob_gap_max": "largest |log S_engine(y) - log S_trainer(y)|",
    "rollout/outside_filter_tokens": "count of sampled tokens the trainer's filtered S gives probability 0",
    "rollout/truncated_prompts": "count of prompts cut to rollout.max_prompt_tokens",
    "rollout/on_policy": "1 if the student sampled the step",
    "response/length_mean": "response tokens per sequence",
    "grad/norm": "gradient norm before clipping",
    "grad/skipped": "1 if the step was skipped (non-finite loss or gradient)",
    "guard/skipped_steps": "skipped steps so far",
    "guard/empty_steps": "steps without trained tokens so far",
    "perf/tokens_per_s": "trained tokens per second of the step",
    "perf/step_s": "seconds of the step",
    "perf/rollout_s": "seconds of the step's rollout (prompts, sync, generate)",
    "perf/generate_s": "seconds sampling",
    "perf/teacher_s": "seconds of the teacher's scores (or waiting for a served reply)",
    "perf/train_s": "seconds of the student's forwards, backwards and optimizer step",
    "perf/sync_s": "seconds pushing weights after an update",
    "perf/wait_s": "seconds the learner waited for a rollout producer",
    "perf/generate_tokens_per_s": "sampled tokens per second of generation",
    "perf/teacher_tokens_per_s": "scored tokens per second of teacher time",
    "perf/train_tokens_per_s": "trained tokens per second of train time",
    "perf/peak_memory_gib": "peak resident (CPU) or CUDA-allocated memory so far",
    "async/staleness": "updates between the weights that sampled the step's rollout and the learner's (rollout.staleness)",
    "async/is_weight_mean": "mean importance weight applied to a stale rollout's terms (truncated at rollout.is_cap)",
    "async/is_weight_max": "largest untruncated importance weight of the step",
    "async/is_clip_frac": "share of trained tokens whose importance weight was truncated",
    "async/learner_wait_s": "seconds the learner waited for the producer's rollout",
    "async/producer_wait_s": "seconds the producer waited for the weights it samples with",
    "ppo/clip_frac": "share of tokens where PPO's clip is active",
    "ppo/approx_kl": "k3 estimate of KL(S_old||S) over the updates",
    "ppo/ratio_mean": "mean ratio S/S_old",
    "ppo/ratio_max": "largest ratio",
    "ppo/ratio_min": "smallest ratio",
    "ppo/skipped_updates": "PPO updates skipped as non-finite",
    "ppo/filtered_out_frac": "share of counted tokens an update pushed out of the sampling filter",
    "estimator/teacher_mass": "T(K): the teacher's mass on the set a top-k estimator sums exactly",
    "estimator/student_mass": "S(K): the student's mass on that set",
    "estimator/clamp_rate": "topk_verl: share of tokens whose loss the clamp set",
    "estimator/baseline": "mean control variate subtracted from the sampled cost",
    "positions/weight_mean": "mean weight on the loss term per response token",
    "positions/gate_rate": "entropy_gate: share of tokens whose gate opens",
    "cost/clipped_frac": "fkl with divergence.clip: share of tokens whose sampled cost was clipped",
    "reward/mean": "mean reward of the step's responses",
    "reward/std": "std of the step's rewards",
    "reward/advantage_mean": "the reward's advantage per response",
    "self/weight_distance": "||theta_T - theta_S|| / ||theta_S|| (a teacher made from the student)",
    "self/lag_updates": "lagged teacher: updates since its last refresh",
    "self/privileged_gain": "mean log T(y | x, context) - log T(y | x) over the student's tokens",
    "align/chunk_tokens_mean": "teacher.align=bytes: tokens per aligned chunk",
    "align/one_to_one_rate": "teacher.align=bytes: share of chunks of one token on each side",
    "align/shared_vocab_mass": "teacher.align_vocab=shared: the teacher's mass on mapped ids at one-to-one positions",
    "episode/turns_mean": "a task with an environment: student turns per episode",
    "episode/student_tokens_mean": "the student's own (trained) tokens per episode",
    "episode/env_tokens_mean": "the environment's tokens per episode (scored by the teacher, never trained)",
    "episode/budget_stops": "count of the step's episodes cut by a length limit (rollout.max_episode_tokens, or a turn at rollout.max_new_tokens)",
    "episode/turn_limit_stops": "count of the step's episodes ended by rollout.max_turns while the environment would answer",
    "tools/calls_mean": "task=calc_tool: tool calls per episode (student turns ending at </calc>)",
    "tools/valid_rate": "share of the answered tool calls whose result is a number (not the error text)",
    "tools/result_used_rate": "of the episodes with a numeric tool result, the share whose final answer is the last result",
    "tools/self_result_rate": "share of episodes whose student turns write <result> themselves (the tool's text)",
}

EVAL: dict[str, str] = {
    "eval/accuracy": "greedy eval accuracy of the student",
    "eval/teacher_accuracy": "greedy eval accuracy of the teacher (measured once)",
    "eval/jsd": "JSD_beta exactly, on the student's greedy eval responses",
    "eval/kl_reverse": "KL(S||T) exactly, on the eval responses",
    "eval/kl_forward": "KL(T||S) exactly, on the eval responses",
    "eval/precision": "k-sample eval: share of correct samples",
    "eval/coverage": "k-sample eval: share of a problem's answers found",
    "eval/pass@k": "k-sample eval: share of problems with a correct sample",
    "eval/entropy": "k-sample eval: the student's mean per-token entropy",
    "eval/self/privileged_gain": "self/privileged_gain on the eval responses",
    "eval/tools/calls_mean": "tools/calls_mean on the student's greedy eval episodes",
    "eval/tools/valid_rate": "tools/valid_rate on the greedy eval episodes",
    "eval/tools/result_used_rate": "tools/result_used_rate on the greedy eval episodes",
    "eval/tools/self_result_rate": "tools/self_result_rate on the greedy eval episodes",
}

# families: a name part in <...> stands for a teacher's name, a divergence's, a metric group's
FAMILIES: dict[str, str] = {
    "eval/<divergence>": "the trained divergence exactly, on the eval responses",
    "exact/<divergence>": "the trained divergence exactly, per token (where it is not one of the three)",
    "teacher/<name>/token_share": "teachers.map: the teacher's share of the step's response tokens",
    "teacher/<name>/jsd": "teachers.map: jsd/mean over the teacher's tokens",
    "teacher/<name>/kl_reverse": "teachers.map: kl/reverse over the teacher's tokens",
    "teacher/<name>/kl_forward": "teachers.map: kl/forward over the teacher's tokens",
    "eval/teacher/<name>/teacher_accuracy": "teachers.map: each teacher's accuracy on its own prompts",
    "eval/teacher/<name>/accuracy": "teachers.map: the student's accuracy on each teacher's prompts",
}

METRICS: dict[str, str] = {**STEP, **EVAL, **FAMILIES}
PPO_METRICS = tuple(k for k in STEP if k.startswith("ppo/"))

_FAMILY = [
    re.compile("^" + re.sub(r"<[a-z]+>", "[A-Za-z0-9_.@]+", re.escape(f).replace(r"\<", "<").replace(r"\>", ">")) + "$") for f in FAMILIES
]


def declared(key: str) -> bool:
    """Whether ``key`` is a declared name or a member of a declared family."""
    return key in STEP or key in EVAL or any(p.match(key) for p in _FAMILY)
