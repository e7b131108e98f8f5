"""GSM8K (or any file in its format) as a Task.

Rows are ``{"question": ..., "answer": "<worked steps>\\n#### <number>"}``. ``task.path`` is
one of: a local ``.jsonl``/``.json``/``.parquet`` file (split into eval/train by
``eval_seed``), a folder or a path with ``{split}`` holding one file per split, a hub id
read with the optional ``datasets`` package, or ``embedded:gsm8k_mini`` (the ~30 problems
shipped with the project).
"""

from __future__ import annotations

import codecs
import json
import random
from functools import cached_property
from pathlib import Path

from opd_exp.config.checks import fail
from opd_exp.config.world import TaskConfig
from opd_exp.runtime.errors import ConfigError, first_line
from opd_exp.tasks.base import Problem, Task, normalize_number

MINI_PATH = Path(__file__).resolve().parent.parent / "data" / "gsm8k_mini.jsonl"
EMBEDDED_FILES = {"embedded:gsm8k_mini": MINI_PATH}
SUFFIXES = (".jsonl", ".json", ".parquet")
ALLOWED = (
    "a local .jsonl/.parquet file or folder, a path with {split}, a hub id like 'openai/gsm8k' (needs `datasets`), or 'embedded:gsm8k_mini'"
)


def row_to_problem(row: dict, where: str, instruction: str = "") -> Problem:
    """One GSM8K row as a Problem (the answer is the number after the last ``####``)."""
    if not isinstance(row, dict):
        raise ConfigError(
            f'task.path: {where} is a JSON {type(row).__name__}, not an object; allowed: {{"question": ..., "answer": "... #### <n>"}}'
        )
    question, answer = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not isinstance(answer, str) or "####" not in answer:
        raise ConfigError(
            f"task.path: {where} is not a GSM8K row (need 'question' and an 'answer' ending in '#### <n>'); allowed: {ALLOWED}"
        )
    if not question.strip():
        raise ConfigError(f"task.path: {where} has an empty question; allowed: a non-empty 'question' in every row")
    final = normalize_number(answer.rsplit("####", 1)[1])
    if final is None:
        raise ConfigError(
            f"task.path: {where} has a final answer that is not a number ({answer.rsplit('####', 1)[1].strip()!r}); allowed: '#### <number>'"
        )
    prompt = question.strip() + (f"\n{instruction}" if instruction else "")
    return Problem(prompt=prompt, answer=final, solution=answer.strip())


def read_rows(path: Path) -> list[dict]:
    """Rows of a .jsonl, .json (a list) or .parquet file."""
    return [row for _, row in read_located(path)]


def read_located(path: Path) -> list[tuple[str, dict]]:
    """Rows of a .jsonl, .json (a list) or .parquet file, each with where it is, 1-based:
    ``line N`` in a .jsonl (blank lines count, as an editor counts them), ``row N`` otherwise."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(
                f"task.path: {str(path)!r} is parquet but `pyarrow` is not installed; allowed: a .jsonl file, or `pip install pyarrow`"
            ) from None
        try:
            return numbered(pq.read_table(path).to_pylist())
        except Exception as exc:  # pyarrow's ArrowInvalid / OSError for a cut or damaged file
            raise ConfigError(
                f"task.path: {str(path)!r} is not a readable parquet file ({first_line(exc, 160)}); allowed: a complete .parquet file"
            ) from None
    data = path.read_bytes()
    data = data.removeprefix(codecs.BOM_UTF8)  # a byte-order mark (Windows editors), as 'utf-8-sig' reads it
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"task.path: {path} line {line} is not UTF-8 text (byte {data[exc.start]:#04x}); allowed: a UTF-8 encoded file"
        ) from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError:
            raise ConfigError(f"task.path: {path} is not valid JSON; allowed: a JSON list of objects") from None
        if not isinstance(data, list):
            raise ConfigError(
                f"task.path: {path} holds a JSON {type(data).__name__}, not a list of rows; allowed: a JSON list of objects "
                f'([{{"question": ..., "answer": "... #### <n>"}}, ...]) or one object per line in a .jsonl file'
            )
        return numbered(data)
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():  # blank lines are skipped
            try:
                rows.append((f"line {n}", json.loads(line)))
            except ValueError:
                raise ConfigError(f"task.path: {path} line {n} is not valid JSON; allowed: one JSON object per line") from None
    return rows


def numbered(rows: list) -> list[tuple[str, dict]]:
    """``row 1``, ``row 2``, ...: where each row of a list (a .json, a parquet table, a hub split) is."""
    return [(f"row {i}", r) for i, r in enumerate(rows, 1)]


def _split_files(folder: Path, split: str) -> list[Path]:
    return sorted(p for p in folder.rglob(f"{split}*") if p.suffix in SUFFIXES and p.is_file())


def _load_hub(cfg: TaskConfig, split: str) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"task.path: {cfg.path!r} is read from the HF hub but `datasets` is not installed; allowed: {ALLOWED} (or `pip install datasets`)"
        ) from None
    try:
        return list(datasets.load_dataset(cfg.path, cfg.hub_config, split=split))
    except Exception as exc:  # offline, unknown id, unknown split, ...
        reason = first_line(exc)
        raise ConfigError(
            f"task.path: cannot load {cfg.path!r} (config {cfg.hub_config!r}, split {split!r}) from the hub: {reason[:160]}; allowed: {ALLOWED}"
        ) from None


def check_duplicates(
    train: list[Problem], evals: list[Problem], where: str, *, places: dict[str, list[str]] | None = None, instruction: str = ""
) -> None:
    """A question in both splits (the eval would score memorised answers) or twice in the eval
    set (counted twice) is refused; repeats within the training split are warned about once.

    ``places``: for one file split into eval and training (``task.n_eval``), where each question
    is in it (``line 3``); a question there twice is the file's own duplicate: the fix is to
    delete all but one of its lines, not to change the split. ``instruction``: the text appended to
    every question (``task.instruction``), left out where a question is shown."""
    import sys
    from collections import Counter

    def short(prompt: str) -> str:
        prompt = prompt.removesuffix(f"\n{instruction}") if instruction else prompt
        return repr(prompt if len(prompt) <= 60 else prompt[:57] + "...")

    def one_file(question: str, landed: str) -> ConfigError:
        at = places[question]
        kind = at[0].split()[0]  # line or row
        numbers = [a.split()[1] for a in at]
        listed = f"{kind}s {', '.join(numbers[:-1])} and {numbers[-1]}"
        return ConfigError(
            f"task.path: {where}: the question {short(question)} is on {listed} of the file, and the file's split into eval and "
            f"training put {landed}; allowed: each question once in the file (deduplicate it: keep one of {listed})"
        )

    seen_eval = Counter(p.prompt for p in evals)
    twice = next((q for q, n in seen_eval.items() if n > 1), None)
    if twice is not None:
        if places is not None:
            raise one_file(twice, f"{seen_eval[twice]} copies in the eval set")
        raise ConfigError(
            f"task.path: {where}: the eval question {short(twice)} appears {seen_eval[twice]} times; allowed: each question once"
        )
    both = next((p.prompt for p in train if p.prompt in seen_eval), None)
    if both is not None:
        if places is not None:
            raise one_file(both, "copies in both")
        raise ConfigError(
            f"task.path: {where}: the question {short(both)} is in both the training and the eval split; allowed: disjoint splits"
        )
    repeats = sum(n - 1 for n in Counter(p.prompt for p in train).values() if n > 1)
    if repeats:
        print(
            f"opd-train: warning: task.path: {where}: {repeats} training question(s) repeat an earlier one; they are kept "
            f"(drawn more often)",
            file=sys.stderr,
            flush=True,
        )


class GSM8KTask(Task):
    name = "gsm8k"

    def __init__(self, cfg: TaskConfig | None = None):
        self.cfg = cfg or TaskConfig(name="gsm8k", path="embedded:gsm8k_mini")
        if not self.cfg.path:
            fail("task.path", self.cfg.path, ALLOWED)

    def _convert(self, rows: list[tuple[str, dict]], where: str) -> list[Problem]:
        """``rows``: (``line N`` / ``row N``, row), as ``read_located`` gives them."""
        return [row_to_problem(r, f"{where} {at}", self.cfg.instruction) for at, r in rows]

    @cached_property
    def _splits(self) -> tuple[list[Problem], list[Problem]]:
        cfg = self.cfg
        path = str(EMBEDDED_FILES.get(cfg.path, cfg.path))
        places = None  # one file split in two: where each question is in it (check_duplicates)
        if "{split}" in path:
            train = self._file(Path(path.format(split=cfg.train_split)))
            evals = self._file(Path(path.format(split=cfg.eval_split)))
        elif Path(path).expanduser().is_dir():
            folder = Path(path).expanduser()
            train, evals = [], []
            for split, out in ((cfg.train_split, train), (cfg.eval_split, evals)):
                files = _split_files(folder, split)
                if not files:
                    raise ConfigError(
                        f"task.path: folder {path!r} has no {split}*.jsonl/.parquet file for split {split!r}; allowed: {ALLOWED}"
                    )
                for f in files:
                    out.extend(self._file(f))
        elif Path(path).expanduser().is_file():
            # One file: a fixed, seeded share becomes the eval set, the rest is for training.
            places = {}
            problems = self._file(Path(path).expanduser(), places)
            order = list(range(len(problems)))
            random.Random(f"gsm8k-eval-{cfg.eval_seed}").shuffle(order)
            n_eval = cfg.n_eval or max(1, len(problems) // 5)
            if n_eval >= len(problems):
                raise ConfigError(
                    f"task.n_eval: got {cfg.n_eval} but {path!r} has only {len(problems)} problems; allowed: fewer than {len(problems)} (0 = a fifth)"
                )
            evals = [problems[i] for i in order[:n_eval]]
            train = [problems[i] for i in order[n_eval:]]
        elif Path(path).suffix in SUFFIXES or path.startswith(("/", ".", "~")):
            raise ConfigError(f"task.path: file {path!r} does not exist; allowed: {ALLOWED}")
        else:
            train = self._convert(numbered(_load_hub(cfg, cfg.train_split)), f"{cfg.path}:{cfg.train_split}")
            evals = self._convert(numbered(_load_hub(cfg, cfg.eval_split)), f"{cfg.path}:{cfg.eval_split}")
        check_duplicates(train, evals, path, places=places, instruction=cfg.instruction)
        if cfg.n_eval:
            evals = evals[: cfg.n_eval]
        # Training order is drawn by task.seed; the eval order stays as stored.
        random.Random(f"gsm8k-train-{cfg.seed}").shuffle(train)
        if cfg.n_train:
            train = train[: cfg.n_train]
        return train, evals

    def _file(self, path: Path, places: dict[str, list[str]] | None = None) -> list[Problem]:
        """The file's problems; ``places`` (when given) gets where each question is in it."""
        if not path.is_file():
            raise ConfigError(f"task.path: file {str(path)!r} does not exist; allowed: {ALLOWED}")
        if path.suffix not in SUFFIXES:
            raise ConfigError(f"task.path: {str(path)!r} has suffix {path.suffix!r}; allowed: {', '.join(SUFFIXES)}")
        rows = read_located(path)
        problems = self._convert(rows, str(path))
        if places is not None:
            for (at, _), p in zip(rows, problems):
                places.setdefault(p.prompt, []).append(at)
        if not problems:
            raise ConfigError(f"task.path: {str(path)!r} holds no problems (empty file); allowed: a file with at least one GSM8K row")
        return problems

    def train_problems(self) -> list[Problem]:
        return list(self._splits[0])

    def eval_problems(self) -> list[Problem]:
        return list(self._splits[1])
