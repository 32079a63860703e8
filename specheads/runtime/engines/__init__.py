"""The engines that run draft -> verify -> accept on the target: ``static`` (``generate``: one batch
until its last request is done), ``continuous`` (continuous batching: a finished row's slot takes
the next request), both over the step of ``static.Generation``; ``step`` (a step's data and
bookkeeping) and ``graphs`` (its device state and CUDA graphs)."""
