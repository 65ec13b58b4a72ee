"""samebits: reproducible LLM inference -- the same request returns the same bits at any batch size."""

from samebits.engine.sequence import CompletionOutput, RequestOutput
from samebits.llm import LLM
from samebits.sampling_params import SamplingParams
from samebits.structured_outputs import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams",
           "batch_invariant"]


def __getattr__(name: str):
    if name == "batch_invariant":
        from samebits.ops.override import batch_invariant
        return batch_invariant
    raise AttributeError(name)
