"""Sweeps: the values each trial gets, which trials stop early, and where a sweep stands.

Optuna's samplers and pruners, driven ask-and-tell; the study is rebuilt from the trials a
sweep's status records, so a search keeps no database. Both drivers (`kiln sweep run` and the
operator) use only these names; neither imports Optuna.
"""

from __future__ import annotations

from kiln.sweep.search import Inheritance, Search, Verdict, inheritance, misfit_of
from kiln.sweep.standing import Standing, standing
from kiln.sweep.trials import own_models, ranked, trial_job

__all__ = ["Inheritance", "Search", "Standing", "Verdict", "inheritance", "misfit_of",
           "own_models", "ranked", "standing", "trial_job"]
