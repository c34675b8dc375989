"""Constrained sampling (OpenAI's response_format, vLLM's structured_outputs: a JSON schema,
any JSON object, a regular expression, a choice of strings, an EBNF grammar) on xgrammar's
grammar matchers.

The engine keeps a matcher for each sample of a structured request. For a step, every such
request scheduled in it gets the bitmask of the tokens that keep its output a prefix of
what the grammar accepts, given the tokens it has so far; the sampler sets every other logit to -inf, and
each token sampled then advances the matcher. A reasoning model's structured output may
start after its thought (`StructuredOutput.starts_after_token_ids`, vLLM's behaviour with a
reasoning parser): until the output has generated the thought's end, the request samples
freely and its matcher waits. A mask needs the request's latest token, so
while a structured request runs the engine reads each step before it schedules the next
(no step is launched ahead of its predecessor's tokens).

JSON is generated without optional whitespace: a small model offered free whitespace
may spend its whole token budget on it.

xgrammar accepts some JSON Schema assertions and then ignores them (`not`, `if`, `allOf` of
several schemas, `uniqueItems`, `contains`, the `dependent*` keywords): an output would not
follow them, so a schema that uses one is refused, naming it and where it is. So is a
grammar that accepts no output at all (nothing may come first), whose masks would leave
the sampler nothing to choose.

A schema can take seconds to compile (a long bounded string, say), so an engine loop
serving others compiles on a thread of its own
(`compile_in_background`); xgrammar releases the GIL meanwhile.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from engine.sampling_params import StructuredOutput, StructuredOutputError

_OBJECT_SCHEMA = json.dumps({"type": "object"})
"""OpenAI's json_object: any JSON object."""
_GRAMMAR_CACHE_BYTES = 256 * 2**20


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        """`vocab_size`: the model's (the logits' width), which may exceed the tokenizer's."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._compiler: Any = None
        self._compile_thread: ThreadPoolExecutor | None = None
        self.matchers: dict[str, Any] = {}
        """Sample request id -> its xgrammar.GrammarMatcher."""
        self._waiting: dict[str, _Preamble] = {}
        """Sample request id -> the free preamble it is still in (its grammar applies once
        the preamble's end has been generated)."""

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def grammar(self, spec: StructuredOutput) -> Any:
        """The compiled grammar for `spec`; StructuredOutputError (a ValueError) for one that
        cannot be followed, or whose output could not follow it (see above)."""
        if spec.json_schema is not None:
            try:
                unenforced = unenforced_keyword(json.loads(spec.json_schema))
            except ValueError:
                unenforced = None  # not JSON: the compiler names the problem
            if unenforced is not None:
                raise _cannot_follow(spec, f"{unenforced}: its grammar would not enforce it")
        grammar = self._compile(spec)
        if not self.first_mask(grammar).any():
            raise _cannot_follow(spec, "it accepts no output at all")
        return grammar

    def first_mask(self, grammar: Any) -> np.ndarray:
        """The tokens `grammar` lets an output start with, as `bitmask` words."""
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(grammar).fill_next_token_bitmask(mask)
        return mask[0].numpy()

    def _compile(self, spec: StructuredOutput) -> Any:
        import xgrammar as xgr

        if self.tokenizer is None:
            raise StructuredOutputError("structured_output needs the model's tokenizer")
        if self._compiler is None:
            stop = [] if self.eos_token_id is None else [self.eos_token_id]
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop
            )
            # The compiler keeps compiled grammars (a request's schema is often the last one's).
            self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=_GRAMMAR_CACHE_BYTES)
        try:
            if spec.regex is not None:
                return self._compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                return self._compiler.compile_grammar(choice_grammar(spec.choice))
            if spec.grammar is not None:
                return self._compiler.compile_grammar(spec.grammar)
            schema = _OBJECT_SCHEMA if spec.json_schema is None else spec.json_schema
            return self._compiler.compile_json_schema(schema, any_whitespace=False)
        except Exception as e:  # xgrammar raises RuntimeError with the reason
            raise _cannot_follow(spec, _reason(e)) from None

    def compile_in_background(self, spec: StructuredOutput) -> Future:
        """`grammar(spec)` on the compile thread (one: compiles run in arrival order, and
        xgrammar spreads each over threads of its own)."""
        if self._compile_thread is None:
            self._compile_thread = ThreadPoolExecutor(1, thread_name_prefix="kvray-grammar")
        return self._compile_thread.submit(self.grammar, spec)

    def shutdown(self) -> None:
        if self._compile_thread is not None:
            self._compile_thread.shutdown(wait=False, cancel_futures=True)

    def add(
        self, request_id: str, grammar: Any, starts_after: tuple[int, ...] | None = None
    ) -> None:
        """`starts_after`: the grammar applies after the output has generated these tokens."""
        import xgrammar as xgr

        self.matchers[request_id] = xgr.GrammarMatcher(grammar)
        if starts_after:
            self._waiting[request_id] = _Preamble(starts_after)

    def remove(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
        self._waiting.pop(request_id, None)

    def constrains(self, request_id: str) -> bool:
        """The request's next token follows its grammar (it has one, past any preamble)."""
        return request_id in self.matchers and request_id not in self._waiting

    def bitmask(self, request_id: str) -> np.ndarray:
        """int32 words, bit i of word w set where token 32w + i may come next."""
        import xgrammar as xgr

        matcher = self.matchers[request_id]
        if matcher.is_terminated():
            # The value is complete (its end token accepted): only that end may follow.
            # SamplingParams refuses what would sample on past it (ignore_eos, min_tokens).
            words = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
            if self.eos_token_id is not None:
                words.view(np.uint32)[self.eos_token_id // 32] = 1 << (self.eos_token_id % 32)
            return words
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(mask)
        return mask[0].numpy()

    def accept(self, request_id: str, token_ids: list[int]) -> None:
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return
        preamble = self._waiting.get(request_id)
        if preamble is not None:
            token_ids = preamble.past_end(token_ids)
            if not preamble.ended:
                return
            del self._waiting[request_id]
        for token in token_ids:
            # False only once the JSON is complete (the mask then allows EOS alone, which
            # ignore_eos may sample again and again): nothing more to follow.
            if matcher.is_terminated() or not matcher.accept_token(token):
                return


class _Preamble:
    """Output tokens before a grammar applies, watched for the sequence that ends them."""

    __slots__ = ("end", "tail", "ended")

    def __init__(self, end: tuple[int, ...]) -> None:
        self.end = list(end)
        self.tail: list[int] = []
        """The last tokens seen, as many as could still be the start of `end`."""
        self.ended = False

    def past_end(self, token_ids: list[int]) -> list[int]:
        """The tokens of `token_ids` after the end sequence (none while it has not come)."""
        for i, token in enumerate(token_ids):
            self.tail.append(token)
            del self.tail[: -len(self.end)]
            if self.tail == self.end:
                self.ended = True
                return list(token_ids[i + 1 :])
        return []


_UNENFORCED = frozenset(
    {"not", "if", "contains", "dependentRequired", "dependentSchemas", "dependencies"}
)
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
"""Keywords whose values map names to schemas (a property may be called "not" or "$ref")."""
_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems", "items"})
_SCHEMA_VALUES = frozenset(
    {
        "items",
        "additionalItems",
        "additionalProperties",
        "propertyNames",
        "unevaluatedItems",
        "unevaluatedProperties",
    }
)


def unenforced_keyword(schema: Any, where: str = "#") -> str | None:
    """The first assertion of JSON schema `schema` that xgrammar would not enforce, with its
    JSON pointer (`"uniqueItems" at #/properties/tags`); None if there is none. Values of
    data keywords (`const`, `enum`, `default`) and property names are not keywords."""
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        at = f"{where}/{_pointer_part(key)}"
        several = key == "allOf" and isinstance(value, list) and len(value) > 1
        if key in _UNENFORCED or several or (key == "uniqueItems" and value is True):
            return f'"{key}"{" of several schemas" if several else ""} at {at}'
        if key in ("anyOf", "oneOf", "allOf") and value == []:
            return f'"{key}" of no schemas at {at}'  # nothing matches; xgrammar takes ""
        if key in SCHEMA_MAPS and isinstance(value, dict):
            parts = [(f"{at}/{_pointer_part(name)}", sub) for name, sub in value.items()]
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            parts = [(f"{at}/{i}", sub) for i, sub in enumerate(value)]
        elif key in _SCHEMA_VALUES:
            parts = [(at, value)]
        else:
            continue
        for sub_where, sub in parts:
            found = unenforced_keyword(sub, sub_where)
            if found is not None:
                return found
    return None


def _pointer_part(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _cannot_follow(spec: StructuredOutput, reason: str) -> StructuredOutputError:
    what = {"json_schema": "a JSON schema", "regex": "a regular expression"}
    return StructuredOutputError(
        f"structured_output: {what.get(spec.kind, 'a grammar')} this server cannot follow: {reason}"
    )


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose only sentences are `choices`."""
    return "root ::= " + " | ".join(_ebnf_string(c) for c in choices)


def _ebnf_string(text: str) -> str:
    escaped = []
    for ch in text:
        if ch in '"\\':
            escaped.append("\\" + ch)
        elif ch in _ESCAPES:
            escaped.append(_ESCAPES[ch])
        elif ord(ch) < 0x20:
            escaped.append(f"\\x{ord(ch):02x}")
        else:
            escaped.append(ch)
    return '"' + "".join(escaped) + '"'


_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _reason(error: Exception) -> str:
    """xgrammar's message without its log prefix ("[time] file.cc:83: ")."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text.splitlines()[-1])
