"""Training stage: DeepSpeed loop, losses, training-time test, checkpoints, logging.

Public API::

    run_train(recipe, target=None, feed=None, eval_feed=None, *, vocab=None) -> dict
    build_head(recipe, target, vocab=None) -> BuiltHead
    load_trained_head(run_dir_or_checkpoint) -> (head, meta)
"""
from .builder import BuiltHead, HeadShapeError, build_head
from .checkpoint import ResumeMismatchError, load_trained_head
from .loop import BatchError, TrainingDivergedError, run_train

__all__ = ["run_train", "build_head", "BuiltHead", "load_trained_head", "HeadShapeError",
           "ResumeMismatchError", "TrainingDivergedError", "BatchError"]
