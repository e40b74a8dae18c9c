"""tpserve: a small, readable, tensor-parallel LLM serving engine."""

from tpserve.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from tpserve.inputs import LoRARequest, TextPrompt, TokensPrompt
from tpserve.outputs import CompletionOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from tpserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "EmbeddingRequestOutput", "Logprob", "SamplingParams",
           "TextPrompt", "TokensPrompt", "LoRARequest", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import tpserve` (e.g. in the tokenizer process) does not import torch.
    if name == "LLM":
        from tpserve.llm import LLM

        return LLM
    raise AttributeError(name)
