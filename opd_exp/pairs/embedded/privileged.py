"""SFT data for a student that has learnt to use privileged context: the self-distillation world.

The lab's on-policy self-distillation world (``model_pair=embedded_self_distill``, docs/world.md)
warms its student up on the default task's worked solutions, a share of them asked with the
privileged context in the prompt, exactly as ``teacher.privileged`` asks the teacher
(``training/teacher_prompt.with_context``)::

    prompt   Reference solution: 9-5=4;4+2=6;#### 6\\n\\n9-5+2=?\\n      (half of the context draws)
    prompt   Reference answer: 6\\n\\n9-5+2=?\\n                         (the other half)
    target   9-5=4;4+2=6;#### 6

So the student asked with the solution copies it (an easy skill a short warm-up learns) while,
asked the bare problem, it still slips: the student with the context in its prompt is a better
teacher than the student without (measured at preparation: manifest ``info``). The rest of the
draws are the plain problems, as for every other student.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from opd_exp.tasks.base import Problem

# bump when what a context draw looks like changes (it is in the student's cache key)
RECIPE = 1
KINDS = ("solution", "answer")  # teacher.privileged's options, drawn alike


def with_privileged(problems: Sequence[Problem], share: float, seed: int) -> list[Problem]:
    """``problems`` with a ``share`` of them (a fixed random subset) asked with privileged context,
    the worked solution or the final answer (one of ``KINDS`` each), the target unchanged."""
    from opd_exp.training.teacher_prompt import with_context

    rng = random.Random(f"privileged-{seed}")
    return [with_context(p, rng.choice(KINDS)) if rng.random() < share else p for p in problems]
