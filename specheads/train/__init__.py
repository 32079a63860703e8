"""Training stage: DeepSpeed loop, losses, training-time test, checkpoints, logging.

Public API::

    run_train(recipe, target=None, feed=None, eval_feed=None, *, vocab=None) -> dict
    build_head(recipe, target, vocab=None) -> BuiltHead

A checkpoint that another recipe wrote is refused with ``specheads.rundir.ResumeMismatchError``.
The trained head is read back with ``specheads.formats.trained.load_trained_head``.
"""
from .builder import BuiltHead, HeadShapeError, build_head
from .loop import run_train
from .step import BatchError, TrainingDivergedError

__all__ = ["run_train", "build_head", "BuiltHead", "HeadShapeError", "TrainingDivergedError", "BatchError"]
