"""Episode rollouts: a rollout engine (the lean sampler, HF ``generate`` or vLLM) run turn by turn
against a task's environment (``opd_exp/tasks/environment.py``), through the engine's ``sample_turns``.

Each turn the student samples, from the whole episode so far given as tokens, until one of the
environment's stop strings, EOS, its turn cap (``rollout.max_new_tokens``) or what is left of the
episode's budget (``rollout.max_episode_tokens``); the environment answers with text, appended as
its tokens, or ends the episode. The ``Batch`` has every episode position after the prompt in
``response_mask`` (the teacher scores them all) and only the student's sampled tokens in
``loss_mask`` (environment tokens are scored, never trained); ``sampling_logprobs`` are the
student's on its own tokens, 0 elsewhere.

Sampling is the wrapped engine's, row-keyed as it is: turn k of row i draws from the generator of
``turn_seed(seed_i, k)``, so the lean and HF engines lay out the same episodes for the same seeds
(without seeds, torch's global RNG, seeded per step by the trainer; vLLM draws its per-request seeds
from the same keys, its own streams). A turn's tokens after its end (a row still sampling while others
finish; a stop string found in the text, not only as the canonical tokens; vLLM, which stops only at
single-token stops, running on to its cap) are discarded: a stopping rule, the kept tokens'
distribution is unchanged.

An episode that runs away (no stop, endless tool calls) ends at its budget or at
``rollout.max_turns``, counted per step (``episode/budget_stops``, ``episode/turn_limit_stops``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from opd_exp.tasks.environment import Environment, Episode, EpisodeView
from opd_exp.training.batch import Batch, Source, positions_from_mask
from opd_exp.training.rollout import RolloutEngine, encode_prompts


def turn_seed(seed: int, turn: int) -> int:
    """Row seed of an episode's ``turn`` (0: the row's own seed, so a first turn draws what a
    one-turn rollout of the same seed draws)."""
    return int(seed) if turn == 0 else (int(seed) * 1_000_003 + 7_919 * turn) % (2**63)


def episode_stats(episodes: Sequence[Episode]) -> dict[str, float]:
    """``episode/*`` of a step's episodes: turns, tokens by writer, the runaway counts."""
    n = max(len(episodes), 1)
    return {
        "episode/turns_mean": sum(len(e.turns) for e in episodes) / n,
        "episode/student_tokens_mean": sum(e.student_tokens for e in episodes) / n,
        "episode/env_tokens_mean": sum(e.env_tokens for e in episodes) / n,
        "episode/budget_stops": float(sum(e.end == "budget" for e in episodes)),
        "episode/turn_limit_stops": float(sum(e.end == "turns" for e in episodes)),
    }


class EpisodeLog:
    """The episodes of the last training rollout, for the step's metrics (the environment's own
    ``tools/*`` and the engine's ``episode/*``). Shared by the student's and the teacher's engine."""

    def __init__(self, env: Environment):
        self.env, self.episodes = env, []

    def record(self, episodes: list[Episode]) -> None:
        self.episodes = episodes

    def metrics(self) -> dict[str, float]:
        if not self.episodes:
            return {}
        return {**episode_stats(self.episodes), **self.env.metrics(self.episodes)}


class EpisodeRollout(RolloutEngine):
    """Episodes over an engine's ``sample_turns`` (``ModuleRollout``'s decoder, or vLLM; see the module docstring).
    ``rollout_cfg``: ``max_turns``, ``max_new_tokens`` (a turn's cap), ``max_episode_tokens``,
    ``max_prompt_tokens`` (the task's prompt only); where it has no ``max_turns`` (a bare-model
    check), the environment's own. ``log``: where the episodes of each call are recorded."""

    def __init__(self, inner: RolloutEngine, env: Environment, rollout_cfg=None, *, log: EpisodeLog | None = None):
        self.inner, self.env, self.log = inner, env, log
        ro = inner.cfg if rollout_cfg is None else rollout_cfg
        self.max_turns = int(getattr(ro, "max_turns", None) or env.max_turns)
        self.turn_cap = int(ro.max_new_tokens)
        self.budget = int(getattr(ro, "max_episode_tokens", None) or self.max_turns * self.turn_cap)
        self.max_prompt_tokens = int(ro.max_prompt_tokens)
        self.source = inner.source
        tok = inner.tokenizer
        self.stop_ids = [tok(s, add_special_tokens=False)["input_ids"] for s in env.stop]
        self.last_episodes: list[Episode] = []

    def sync(self, model, version: int) -> None:
        self.inner.sync(model, version)

    def _encode_reply(self, text: str) -> list[int]:
        # environment text never becomes a special token (an "<eos>" in a reply is its characters)
        return self.inner.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def _turn_end(self, ids: list[int], cap: int, eos: set[int]) -> tuple[int, str]:
        """(tokens the turn keeps, why it ended: eos | stop | length) from a row's sampled ``ids``."""
        tok = self.inner.tokenizer
        limit = min(cap, len(ids))
        end, why = limit, "length"
        for k in range(limit):
            if ids[k] in eos:
                end, why = k + 1, "eos"
                break
        for s in self.stop_ids:  # the canonical tokens of a stop string
            L = len(s)
            for k in range(L, end + 1):
                if ids[k - L : k] == s:
                    if k < end or why == "length":
                        end, why = k, "stop"
                    break
        if self.env.stop:  # the stop string spelled by other tokens: the shortest prefix whose text holds it
            text = tok.decode(ids[:end], skip_special_tokens=True)
            if any(s in text for s in self.env.stop):
                lo, hi = 1, end
                while lo < hi:
                    mid = (lo + hi) // 2
                    if any(s in tok.decode(ids[:mid], skip_special_tokens=True) for s in self.env.stop):
                        hi = mid
                    else:
                        lo = mid + 1
                if lo < end or why == "length":
                    end, why = lo, "stop"
        return end, why

    def generate(self, prompts: Sequence[str], seeds: Sequence[int] | None = None, *, n_samples: int = 1, greedy: bool = False) -> Batch:
        inner, tok = self.inner, self.inner.tokenizer
        ids, mask = encode_prompts(tok, prompts, self.max_prompt_tokens)
        ids, mask = ids.repeat_interleave(n_samples, 0), mask.repeat_interleave(n_samples, 0)
        N = ids.shape[0]
        if seeds is not None and len(seeds) != N:
            raise ValueError(f"seeds has {len(seeds)} seeds for {N} rows")
        eos_set, pad = set(inner.eos_ids), inner.pad
        prompt_rows = [ids[r][mask[r].bool()].tolist() for r in range(N)]
        tokens: list[list[int]] = [[] for _ in range(N)]
        student: list[list[bool]] = [[] for _ in range(N)]
        logprobs: list[list[float]] = [[] for _ in range(N)]
        episodes = [Episode(prompt=prompts[r // n_samples]) for r in range(N)]
        active = list(range(N))
        lp_dtype = torch.float32
        for turn in range(self.max_turns):
            if not active:
                break
            caps = [min(self.turn_cap, self.budget - len(tokens[r])) for r in active]
            row_seeds = None if greedy or seeds is None else [turn_seed(seeds[r], turn) for r in active]
            out = inner.sample_turns([prompt_rows[r] + tokens[r] for r in active], caps, row_seeds, greedy=greedy, stop_ids=self.stop_ids)
            sampled, lps = out.tokens, out.logprobs
            if lps is not None:
                lp_dtype = out.dtype
            still = []
            for j, r in enumerate(active):
                n, why = self._turn_end(sampled[j], caps[j], eos_set)
                ep = episodes[r]
                turn_ids = sampled[j][:n]
                tokens[r] += turn_ids
                student[r] += [True] * n
                logprobs[r] += lps[j][:n] if lps is not None else [0.0] * n
                ep.turns.append(tok.decode(turn_ids, skip_special_tokens=True))
                ep.student_tokens += n
                if why == "length":
                    ep.end = "budget"  # a turn cut at its cap or at the episode's budget
                    continue
                view = EpisodeView(
                    prompt=ep.prompt,
                    text=tok.decode(tokens[r], skip_special_tokens=True),
                    turn=turn + 1,
                    eos=why == "eos",
                    last_turn=ep.turns[-1],
                )
                reply = self.env.step(view)
                if reply.done:
                    ep.end, ep.reward = ("eos" if why == "eos" else "env"), reply.reward
                    continue
                if turn + 1 >= self.max_turns:
                    ep.end = "turns"  # the environment would answer: the turn limit ends it
                    continue
                reply_ids = self._encode_reply(reply.text)
                if len(tokens[r]) + len(reply_ids) >= self.budget:
                    ep.end = "budget"  # no room for the answer and another student token
                    continue
                tokens[r] += reply_ids
                student[r] += [False] * len(reply_ids)
                logprobs[r] += [0.0] * len(reply_ids)
                ep.replies.append(reply.text)
                ep.env_tokens += len(reply_ids)
                still.append(r)
            active = still
        self.last_episodes = episodes
        if self.log is not None:
            self.log.record(episodes)
        return self._batch(ids, mask, tokens, student, None if greedy else logprobs, pad, n_samples, lp_dtype)

    def _batch(self, ids, mask, tokens, student, logprobs, pad: int, n_samples: int, lp_dtype=torch.float32) -> Batch:
        """The episodes laid out as every engine lays out a rollout (left-padded prompts, the
        episode from column P, pad after it), with the two masks."""
        N = ids.shape[0]
        R = max(1, max(len(t) for t in tokens))
        response = torch.full((N, R), pad, dtype=torch.long)
        loss_mask = torch.zeros((N, R), dtype=torch.bool)
        lp = torch.zeros((N, R), dtype=lp_dtype)
        for r in range(N):
            n = len(tokens[r])
            if n:
                response[r, :n] = torch.tensor(tokens[r], dtype=torch.long)
                loss_mask[r, :n] = torch.tensor(student[r])
                if logprobs is not None:
                    lp[r, :n] = torch.tensor(logprobs[r], dtype=lp_dtype)
        lengths = torch.tensor([len(t) for t in tokens])
        response_mask = torch.arange(R)[None, :] < lengths[:, None]
        device = self.inner.device
        full_mask = torch.cat([mask, torch.ones_like(response)], dim=1)
        return Batch(
            input_ids=torch.cat([ids, response], dim=1).to(device),
            attention_mask=full_mask.to(device),
            position_ids=positions_from_mask(full_mask).to(device),
            prompt_len=ids.shape[1],
            response_mask=response_mask.to(device),
            prompt_index=torch.arange(N // n_samples).repeat_interleave(n_samples).to(device),
            source=Source(self.source),
            sampling_logprobs=None if logprobs is None else lp.to(device),
            loss_mask=loss_mask.to(device),
        )


class EpisodeSource:
    """A rollout source (``training/producer.py``'s ``InLoop``) whose step metrics also say what
    its episodes did (``EpisodeLog``); everything else is the wrapped source's. ``train_env_tokens``
    (``rollout.env_tokens=trained``, an ablation): the training batches' loss mask is their whole
    layout, the environment's tokens trained as if the student had written them (no engine sampled
    those, so no engine log-probs either: ``rollout/logprob_gap`` is not measured)."""

    def __init__(self, inner, log: EpisodeLog, *, train_env_tokens: bool = False):
        self.inner, self.log, self.train_env_tokens = inner, log, train_env_tokens

    def generate(self, step: int, prompts: list[str], seeds, *, on_policy: bool) -> Batch:
        batch = self.inner.generate(step, prompts, seeds, on_policy=on_policy)
        if self.train_env_tokens:
            batch = dataclasses.replace(batch, loss_mask=batch.response_mask.clone(), sampling_logprobs=None)
        return batch

    def metrics(self) -> dict[str, float]:
        return {**self.inner.metrics(), **self.log.metrics()}

    def __getattr__(self, name):  # state, load_state, close: the wrapped source's
        return getattr(self.inner, name)


def episode_engine(engine: RolloutEngine, env: Environment, rollout_cfg=None, *, log: EpisodeLog | None = None) -> EpisodeRollout:
    """``engine`` run as episodes against ``env``; an engine without ``sample_turns`` cannot be (one line)."""
    from opd_exp.runtime.errors import ConfigError

    if isinstance(engine, EpisodeRollout):
        engine = engine.inner
    if type(engine).sample_turns is RolloutEngine.sample_turns:
        raise ConfigError(
            f"rollout.engine={type(engine).__name__} is not allowed with a task that has an environment (the engine "
            "cannot sample a turn from an episode's tokens: no sample_turns); allowed: lean, hf, auto or vllm"
        )
    return EpisodeRollout(engine, env, rollout_cfg, log=log)
