"""Step-time modelling: a step's features, a fitted features → duration model, and the SLO-aware step budget.

Plain Python + numpy (no torch): the scheduler and the simulator both import it.
"""

from twophase.steptime.features import FEATURE_NAMES, StepFeatures, step_features
from twophase.steptime.model import StepTimeModel, fit_step_time_model, nnls

__all__ = ["FEATURE_NAMES", "StepFeatures", "StepTimeModel", "fit_step_time_model", "nnls", "step_features"]
