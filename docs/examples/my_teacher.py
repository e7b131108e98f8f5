"""A plugin teacher scorer in one file: the pair's teacher with its logits tempered by a factor of
its own (``TEMPERED_TEACHER_FACTOR``, default 2: a softer teacher), scored in process.

    OPD_PLUGINS=docs/examples/my_teacher.py opd-train teacher.name=tempered

A scorer gets a ``ScorerContext`` (the run's config, the pair's teacher module, tokenizer,
vocabulary, device) and returns a ``TeacherScorer``; ``sync``/``state_dict`` are there if it
follows the student (see training/teacher_student.py).
"""

import os

from opd_exp.training.scoring import InProcessTeacher, TeacherScores
from opd_exp.training.teachers import register_teacher_scorer

FACTOR = float(os.environ.get("TEMPERED_TEACHER_FACTOR", "2.0"))


class TemperedTeacher(InProcessTeacher):
    def score(self, batch):
        return TeacherScores(logits=self.logits(batch) / FACTOR)


@register_teacher_scorer("tempered")
def tempered(ctx):
    return ctx.in_process(TemperedTeacher)
