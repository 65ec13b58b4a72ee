"""The communication layer of tensor parallelism: ``group.TPGroup``, a rank's place in the
process group (gloo on CPU, NCCL on CUDA) and the collectives the parallel layers use
(``samebits.models.parallel``). The ranks' processes are the engine's (``samebits.engine.executor``
and ``samebits.engine.worker``)."""
