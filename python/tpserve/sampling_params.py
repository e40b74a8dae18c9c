"""Per-request sampling parameters, shared by the offline API and the server messages."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec


MAX_LOGPROBS = 20
SEED_LIMIT = 2**63  # seeds are in [0, SEED_LIMIT)
PRIORITY_LIMIT = 2**63  # priorities are int64, as msgpack carries them
# Requests reach the rank processes as msgpack, which carries 64-bit integers: every integer field is below this.
INT_LIMIT = SEED_LIMIT
# Temperatures below this are greedy, as in vLLM: dividing logits by 1e-50 would overflow to inf
# (and the row would sample at random), while any temperature this small is an argmax anyway.
GREEDY_TEMPERATURE = 1e-5
MAX_PENALTY = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty
MAX_LOGIT_BIAS = 100.0
# Stop strings are searched in every output chunk (and a tail that may grow into one is held back):
# bounded so that one request cannot make that search slow. OpenAI allows 4 strings.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
# Every generated token is looked up in stop_token_ids, and while min_tokens holds each one is a logit
# edit uploaded every step: bounded as the stop strings are. 256 is far more than any model's end tokens.
MAX_STOP_TOKEN_IDS = 256
# Every bad word's token sequence is matched against the output's tail for each sampled token (on the host).
MAX_BAD_WORDS = 64
MAX_CACHE_SALT = 256  # characters: a salt names a tenant, it is no payload

STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")
# SamplingParams' fields by type, checked (and numpy scalars made plain) when it is made: the
# request is decoded with these types in every rank process, where a wrong type would be fatal.
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INT_FIELDS = ("n", "top_k", "min_tokens", "priority")
_OPTIONAL_INT_FIELDS = ("max_tokens", "seed", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
# What a pooled request answers with instead of tokens: its embedding (the final hidden state of its last token), or a
# sequence classifier's class logits there
POOLING_TASKS = ("embed", "classify")


def _is_int(value: Any) -> bool:
    """An int or a numpy integer, not a bool (numpy's bool is no numbers.Integral)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _as_int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value >= INT_LIMIT:
        raise ValueError(f"{name} must be below 2**63, got {value}")
    return int(value)


def _as_float(name: str, value: Any) -> float:
    if not _is_number(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _as_strings(name: str, value: Any, one_alone: bool) -> list[str] | None:
    """A list (or tuple) of strings as a list of plain strings; ``one_alone``: a string alone is a list of one."""
    if value is None:
        return None
    strings = [value] if one_alone and isinstance(value, str) else value
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) for s in strings):
        kinds = "a string or a list of strings" if one_alone else "a list of strings"
        raise ValueError(f"{name} must be {kinds}, got {value!r}")
    return [str(s) for s in strings]


def _as_token_ids(name: str, value: Any) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(_is_int(t) for t in value):
        raise ValueError(f"{name} must be a list of integers, got {value!r}")
    return [_as_int(f"{name} token id", t) for t in value]


def _as_token_sequences(value: Any) -> list[list[int]] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(ids, (list, tuple)) for ids in value):
        raise ValueError(f"bad_words_token_ids must be a list of token-id lists, got {value!r}")
    return [_as_token_ids("bad_words_token_ids", ids) for ids in value]


def _as_logit_bias(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(_is_int(t) and _is_number(b) for t, b in value.items()):
        raise ValueError(f"logit_bias must map integer token ids to numbers, got {value!r}")
    return {_as_int("logit_bias token id", t): float(b) for t, b in value.items()}


class StructuredOutput(msgspec.Struct, frozen=True):
    """A constraint on the whole output: ``kind`` is one of STRUCTURED_KINDS; ``spec`` is the
    JSON schema text (json_schema), the regex, the EBNF grammar, or the structural tag's JSON (xgrammar's
    ``{"type": "structural_tag", "format": ...}``, or the older ``{"structures": [...], "triggers": [...]}``); empty for
    json_object."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured output spec must be a string, got {self.spec!r}")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"structured output {self.kind} needs a non-empty spec")

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.spec)


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to pick each next token and when to stop.

    temperature 0 (or below 1e-5) means greedy. top_k -1 (or 0) disables top-k. A request with a ``seed``
    samples the same tokens every time, whatever else is in its batch.

    Logit edits, applied in this order before temperature and the filters (greedy rows too), as vLLM
    (and transformers' ``sequence_bias`` before its repetition penalty) applies them: ``logit_bias``
    (token id -> added value), with end-of-sequence and ``stop_token_ids`` banned until ``min_tokens``
    tokens are out and ``bad_words`` banned, then ``repetition_penalty`` (transformers' rule: a logit
    of a token already in the prompt or the output is divided by it when positive, multiplied when
    negative), then ``frequency_penalty`` times the token's count in the output and ``presence_penalty``
    if it occurs there (OpenAI's rule), then only ``allowed_token_ids`` may be sampled (if given), then
    ``structured`` allows only the tokens its grammar accepts.

    ``bad_words`` (vLLM's): words the output never contains as tokenized, each at the start of the text
    and after a space (both tokenizations are banned). A word's last token is banned wherever the
    output so far ends with the tokens before it, so the word may still appear spelt by other tokens.
    The tokenizer fills ``bad_words_token_ids`` from them (a model without a tokenizer takes the token
    sequences there directly). A request with a bad word of several tokens needs its last token before
    its next step is planned: while it samples, its batch's steps do not overlap with the host's work (slower
    for the whole batch, correct). Neither may be combined with ``structured``.

    ``stop`` may be one string or a list of at most 16 (``MAX_STOP_STRINGS``), each at most 512
    characters (``MAX_STOP_CHARS``); ``stop_token_ids`` may hold at most 256 (``MAX_STOP_TOKEN_IDS``).
    A value of the wrong type is a ValueError naming the field; numpy numbers are taken (and kept as
    plain ints and floats).
    """

    n: int = 1  # completions of each prompt (see ``choices``)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    stop: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # the text leaves out special tokens (EOS, <|im_end|>, ...)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    structured: StructuredOutput | None = None
    # None: no log-probabilities; n >= 0: each sampled token's log-probability under the model
    # (before temperature, penalties and filters) plus the n most likely tokens' at that position.
    logprobs: int | None = None
    # None: none; n >= 0: the log-probability of every prompt token after the first (given the ones
    # before it) and the n most likely tokens' at each of those positions (OpenAI's completions
    # ``echo`` with ``logprobs``). Such a prompt is computed whole: the prefix cache is not used for it.
    prompt_logprobs: int | None = None
    # vLLM's: only the prompt's last k tokens are kept (left truncation); -1: as many as the context holds with
    # max_tokens (or one token) after them
    truncate_prompt_tokens: int | None = None
    # vLLM's: requests share cached prefixes only with requests of the same salt (a tenant's prompts are neither
    # reused nor timed by others)
    cache_salt: str | None = None
    # A pooled request (one of POOLING_TASKS): "embed" (``/v1/embeddings``, ``LLM.embed``) is answered with the final
    # (normed) hidden state of the prompt's last token, "classify" (``/classify``, a cross-encoder's score) with a
    # classifier's logits there; nothing is generated (the sampling fields are unused)
    pooling: str | None = None
    # vLLM's: under the priority schedule policy, waiting requests are admitted lowest value first (then in order
    # of arrival) and a running request of a higher value is preempted first; 0 under any other policy
    priority: int = 0
    # a LoRA adapter the engine was started with (by its name; tpserve.models.adapters), or None: the base model
    lora: str | None = None

    def __post_init__(self) -> None:
        self._check_types()
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.pooling is not None and self.pooling not in POOLING_TASKS:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TASKS)} (or None), got {self.pooling!r}")
        if self.pooled and not (self.logprobs is None and self.prompt_logprobs is None and self.structured is None
                                and self.n == 1):
            raise ValueError(f"a pooled request ({self.pooling}) generates no tokens: it takes no logprobs, "
                             "prompt_logprobs or structured output, and n 1")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise ValueError(f"lora must be a LoRA adapter's name, got {self.lora!r}")
        if not -PRIORITY_LIMIT <= self.priority < PRIORITY_LIMIT:
            raise ValueError(f"priority must be in [-2**63, 2**63), got {self.priority}")
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT):
            raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1, got {self.truncate_prompt_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for token, bias in (self.logit_bias or {}).items():
            if token < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
        for name, ids in (("allowed_token_ids", self.allowed_token_ids or []),
                          ("bad_words_token_ids", [t for word in self.bad_words_token_ids or [] for t in word])):
            if any(t < 0 for t in ids):
                raise ValueError(f"{name} must be token ids >= 0, got {min(ids)}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty (no token could be sampled)")
        if self.bad_words is not None:
            if any(not w.strip() for w in self.bad_words):
                raise ValueError("bad_words must not be empty or only spaces")
            if len(self.bad_words) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words may hold at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")
            if any(len(w) > MAX_STOP_CHARS for w in self.bad_words):
                raise ValueError(f"bad_words must be at most {MAX_STOP_CHARS} characters each")
        if self.structured is not None and (self.allowed_token_ids is not None or self.bad_words or self.bad_words_token_ids):
            raise ValueError("allowed_token_ids and bad_words cannot be combined with structured output: a grammar "
                             "that allows only banned tokens would leave nothing to sample")
        if self.bad_words_token_ids is not None and any(not ids for ids in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids must not hold an empty token list")
        if self.bad_words_token_ids is not None and len(self.bad_words_token_ids) > 2 * MAX_BAD_WORDS:
            raise ValueError(f"bad_words_token_ids may hold at most {2 * MAX_BAD_WORDS} token lists")
        if self.stop is not None and any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.stop is not None and len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for i, stop in enumerate(self.stop or []):
            if len(stop) > MAX_STOP_CHARS:
                raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters, got {len(stop)} (stop[{i}])")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} token ids, got {len(self.stop_token_ids)}"
            )

    def _check_types(self) -> None:
        """A ValueError naming a field of the wrong type; numpy scalars and tuples become plain values."""
        for name in _FLOAT_FIELDS:
            setattr(self, name, _as_float(name, getattr(self, name)))
        for name in _INT_FIELDS:
            setattr(self, name, _as_int(name, getattr(self, name)))
        for name in _OPTIONAL_INT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, _as_int(name, value))
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        self.stop = _as_strings("stop", self.stop, one_alone=True)
        self.stop_token_ids = _as_token_ids("stop_token_ids", self.stop_token_ids)
        self.logit_bias = _as_logit_bias(self.logit_bias)
        allowed = _as_token_ids("allowed_token_ids", self.allowed_token_ids)
        self.allowed_token_ids = None if allowed is None else list(dict.fromkeys(allowed))  # a set, in given order
        self.bad_words = _as_strings("bad_words", self.bad_words, one_alone=False)
        self.bad_words_token_ids = _as_token_sequences(self.bad_words_token_ids)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {self.structured!r}")

    def choices(self) -> list[SamplingParams]:
        """The params of each of the ``n`` completions (one request each, n 1): with a seed, completion
        i samples with seed + i (reproducible and different); without one, each gets its own seed."""
        return [
            msgspec.structs.replace(self, n=1, seed=None if self.seed is None else (self.seed + i) % SEED_LIMIT)
            for i in range(self.n)
        ]

    @property
    def prefix_key(self) -> str | None:
        """Whose cached prefixes this request may share: its ``cache_salt``'s, apart for each LoRA adapter (an
        adapter changes every layer's keys and values)."""
        if self.lora is None:
            return self.cache_salt
        return f"{self.cache_salt or ''}\x00lora:{self.lora}"

    @property
    def pooled(self) -> bool:
        """Answered with a vector of the prompt's last token (``pooling``), not generated tokens."""
        return self.pooling is not None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """Needs the request's token history on the device."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def stops_before_min_tokens(self, eos_ids: Iterable[int]) -> list[int]:
        """The tokens banned while fewer than ``min_tokens`` have been generated."""
        return sorted(set(self.stop_token_ids or ()) | (set() if self.ignore_eos else set(eos_ids)))

    def token_id_fields(self) -> list[tuple[str, list[int]]]:
        """Each field that holds token ids, with them: what must lie inside the model's vocabulary."""
        return [("stop_token_ids", self.stop_token_ids or []), ("logit_bias", list(self.logit_bias or {})),
                ("allowed_token_ids", self.allowed_token_ids or []),
                ("bad_words_token_ids", [t for ids in self.bad_words_token_ids or [] for t in ids])]

    @property
    def needs_output_history(self) -> bool:
        """A bad word of several tokens: the next step's bans depend on the last token sampled."""
        return any(len(ids) > 1 for ids in self.bad_words_token_ids or ())

    def bad_word_bans(self, output_ids: Sequence[int]) -> list[int]:
        """The tokens that would complete a bad word after ``output_ids`` (every output token so far)."""
        bans = []
        for ids in self.bad_words_token_ids or ():
            before = len(ids) - 1
            if before <= len(output_ids) and list(output_ids[len(output_ids) - before:]) == ids[:before]:
                bans.append(ids[-1])
        return bans

    @property
    def edits_logits(self) -> bool:
        return (self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0 or self.structured is not None
                or self.allowed_token_ids is not None or bool(self.bad_words_token_ids))
