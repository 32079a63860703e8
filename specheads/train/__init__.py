"""Training stage: DeepSpeed loop, losses, training-time test, checkpoints, logging.

Public API::

    run_train(recipe, target=None, feed=None, eval_feed=None, *, vocab=None) -> dict
    build_head(recipe, target, vocab=None) -> BuiltHead

The trained head is read back with ``specheads.export.trained.load_trained_head``.
"""
from .builder import BuiltHead, HeadShapeError, build_head
from .checkpoint import ResumeMismatchError
from .loop import BatchError, TrainingDivergedError, run_train

__all__ = ["run_train", "build_head", "BuiltHead", "HeadShapeError", "ResumeMismatchError",
           "TrainingDivergedError", "BatchError"]
