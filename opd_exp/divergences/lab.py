"""The lab's teacher-free signals, registered only when asked for (``OPD_PLUGINS=opd_exp.divergences.lab``).

They are written in the divergence interface so the estimators and loss forms apply to them
unchanged, but they are not divergences between student and teacher (D(S, S) > 0), so they
stay out of the registry the suite checks (see ``fixed_negative.py``).
"""

from __future__ import annotations

from .catalog import register_divergence
from .fixed_negative import FixedNegative

register_divergence(FixedNegative)
