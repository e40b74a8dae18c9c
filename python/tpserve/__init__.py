"""tpserve: a small, readable, tensor-parallel LLM serving engine."""

from tpserve.sampling_params import SamplingParams

__version__ = "0.1.0"
_LLM_NAMES = ("LLM", "CompletionOutput", "RequestOutput", "EmbeddingRequestOutput")
__all__ = [*_LLM_NAMES, "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import tpserve` (e.g. in the tokenizer process) does not import torch.
    if name in _LLM_NAMES:
        from tpserve import llm

        return getattr(llm, name)
    raise AttributeError(name)
