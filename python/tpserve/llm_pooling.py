"""The offline ``LLM``'s pooling methods (vLLM's ``embed``, ``classify`` and ``score``): each prompt runs as a pooled
request (``SamplingParams.pooling``) through ``generate``, and its vector becomes the answer as the server's
/v1/embeddings, /classify and /v1/score make it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tpserve.outputs import (
    ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput,
    ScoringOutput, ScoringRequestOutput,
)
from tpserve.pooling import class_scores, embedding_vector, model_head, pair_texts
from tpserve.sampling_params import SamplingParams
from tpserve.message.frontend import TokenizeRequest

if TYPE_CHECKING:
    from tpserve.config import ModelConfig
    from tpserve.engine_config import EngineConfig

Prompts = str | Mapping[str, Any] | Iterable[str | Sequence[int] | Mapping[str, Any]]


class PoolingMethods:
    """Mixed into ``LLM``, whose ``generate``, ``config``, ``model_config`` and ``tokenizer`` they use."""

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Any
    generate: Callable[..., list[RequestOutput]]
    _live_driver: Callable[[str], Any]  # raises, naming the method, after close()

    def embed(
        self,
        prompts: Prompts,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
        dimensions: int | None = None,
        normalize: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (prompts as ``generate`` takes them): the final hidden state of its last token,
        cut to its first ``dimensions`` values and L2-normalized (``normalize``), as /v1/embeddings answers."""
        self._live_driver("embed")
        params = SamplingParams(pooling="embed", max_tokens=1, truncate_prompt_tokens=truncate_prompt_tokens)
        results = self.generate(prompts, params, use_tqdm)
        return [EmbeddingRequestOutput(r.prompt_token_ids, EmbeddingOutput(
            embedding_vector(r.hidden_state, dimensions, normalize).tolist()), r.request_id) for r in results]

    def classify(
        self,
        prompts: Prompts,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
        use_activation: bool = True,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities from a sequence classifier (a ``*ForSequenceClassification``
        checkpoint): its score head's logits at the last token through the model's activation (the softmax; a sigmoid
        for one class or a multi-label model), as /classify answers; ``use_activation`` False: the logits."""
        self._live_driver("classify")
        classifier = self.model_config.classifier
        activation = classifier.classify_activation if classifier is not None and use_activation else "none"
        return [ClassificationRequestOutput(r.prompt_token_ids, ClassificationOutput(class_scores(r.hidden_state,
                activation).tolist()), r.request_id) for r in self._classified(prompts, use_tqdm, truncate_prompt_tokens)]

    def _classified(self, prompts: Any, use_tqdm: bool, truncate_prompt_tokens: int | None) -> list[RequestOutput]:
        params = SamplingParams(pooling="classify", max_tokens=1, truncate_prompt_tokens=truncate_prompt_tokens)
        return self.generate(prompts, params, use_tqdm)

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: a score for each pair (data_1[i], data_2[i]) (one data_1 text pairs with every
        data_2), as /v1/score answers: a cross-encoder's (a classifier of one class) activated logit for the pair
        as one prompt, an embedding model's cosine of the two texts' embeddings."""
        self._live_driver("score")
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        if not first or not second or not all(isinstance(t, str) for t in first + second):
            raise TypeError("data_1 and data_2 must be a text or a non-empty list of texts")
        pairs = [(first[i], second[j]) for i, j in pair_texts(first, second, ("data_1", "data_2"))]
        head = model_head(self.model_config)
        problem = head.unserved("score")
        if problem is not None:
            raise ValueError(problem)
        if head.classifies:
            if self.tokenizer is None:
                raise ValueError("score needs the model's tokenizer (it tokenizes each pair as one prompt)")
            # each pair tokenized by the tokenizer workers' own code, so as the server tokenizes it (joined for an LLM
            # as reranker, else the pair encoding, cut longer text first)
            from tpserve.tokenizer.prepare import PromptLimits, PromptPreparer

            params = SamplingParams(pooling="classify", max_tokens=1, truncate_prompt_tokens=truncate_prompt_tokens)
            context = self.config.max_model_len or self.model_config.context_length
            preparer = PromptPreparer(self.tokenizer, PromptLimits(context, self.model_config.vocab_size))
            prompts = [preparer.input_ids(TokenizeRequest(rid=0, params=params, text=a + b if head.joins_pairs else a,
                                                          text_pair=None if head.joins_pairs else b))[0]
                       for a, b in pairs]
            return [ScoringRequestOutput(r.prompt_token_ids, ScoringOutput(float(class_scores(
                r.hidden_state, head.score_activation)[0])), r.request_id) for r in self._classified(
                    prompts, use_tqdm, truncate_prompt_tokens)]
        texts = list(dict.fromkeys(first + second))
        embedded = dict(zip(texts, self.embed(texts, use_tqdm, truncate_prompt_tokens)))
        return [ScoringRequestOutput(embedded[a].prompt_token_ids + embedded[b].prompt_token_ids, ScoringOutput(
            float(np.dot(embedded[a].outputs.embedding, embedded[b].outputs.embedding))),
            f"{embedded[a].request_id}_{embedded[b].request_id}") for a, b in pairs]  # as vLLM names the pair
