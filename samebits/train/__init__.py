"""The trainer side of RL: ``TrainableLM`` computes, with gradients, the logprobs the engine
sampled with (bitwise, in the invariant mode)."""

from samebits.train.trainable import TrainableLM

__all__ = ["TrainableLM"]
