"""OpenAI's HTTP requests as pydantic models, validated strictly: wrong types, unknown
fields and out-of-range values are 400s naming the field (engine.api.errors). The
responses' models are in engine.api.responses.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from engine.sampling_params import MAX_LOGPROBS


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: with include_usage, every chunk carries the usage so far."""


class JSONSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    """Output always follows the schema, strict or not."""


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsParams(_Request):
    """vLLM's structured_outputs: one of a JSON schema (an object, or its text), a regular
    expression, a choice of strings, an EBNF grammar (xgrammar's dialect, start rule
    `root`), or any JSON object."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(_Request):
    """Fields both endpoints share: OpenAI's, then vLLM's extensions."""

    model: str | None = None
    """None: the only model served."""
    n: int = Field(default=1, ge=1, le=128)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    """OpenAI's: token ids (as JSON object keys) -> a bias in [-100, 100]."""
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int | None = None
    """Scheduling priority (lower runs first); never more urgent than the tenant's own."""
    cache_salt: str | None = Field(default=None, min_length=1)
    """vLLM's: the prompt's cached blocks are shared only with requests of the same salt
    (within the tenant's own)."""
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1)
    """vLLM's: sample only these tokens."""
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    """vLLM's: keep only the prompt's last N tokens (-1: as many as max_model_len allows)."""
    return_tokens_as_token_ids: bool = False
    """vLLM's: logprobs name tokens "token_id:<id>" instead of by their text."""
    return_token_ids: bool = False
    """vLLM's: the prompt's and each choice's token ids beside the text (streamed: the
    prompt's on the first chunk, each chunk's new tokens)."""
    response_format: ResponseFormat | None = None
    """OpenAI's: free text, any JSON object, or JSON that follows a schema."""
    structured_outputs: StructuredOutputsParams | None = None
    """vLLM's: the output follows a JSON schema, a regex, a choice or a grammar."""

    @field_validator("stream_options")
    @classmethod
    def _stream_options_only_when_streaming(
        cls, options: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        # `stream` is declared, so validated, first; one that failed is reported on its own.
        if options is not None and not info.data.get("stream", True):
            raise PydanticCustomError(
                "stream_options_without_stream", "only allowed when `stream` is true"
            )
        return options


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    """Each choice starts with its prompt (with logprobs: the prompt tokens' too); with
    max_tokens=0, the prompt alone."""
    best_of: int | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """vLLM's: each choice carries the top-N logprobs of every prompt token."""
    add_special_tokens: bool = True
    """vLLM's: a text prompt gets the tokenizer's special tokens (a Llama 3's BOS)."""
    use_beam_search: bool = False
    """vLLM's: a beam search `best_of` (else `n`) beams wide returns the `n` best sequences
    (engine/api/beam_search.py); not streamed."""
    length_penalty: float = 1.0
    """Beam search: a sequence scores cum_logprob / length ** length_penalty."""
    early_stopping: bool | Literal["never"] = "never"
    """Beam search: true, stop once n sequences are finished; false, once a better one is
    unlikely; "never", once none can come."""

    @property
    def several_prompts(self) -> bool:
        """`prompt` lists several prompts (strings or id lists); a list of ids is one."""
        prompt = self.prompt
        return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCallParam(_Request):
    name: str
    arguments: str
    """The call's arguments as JSON text (an object)."""


class ToolCallParam(_Request):
    """A call an earlier assistant message made."""

    id: str
    type: Literal["function"]
    function: FunctionCallParam


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    """An assistant message's calls (its content may then be null)."""
    tool_call_id: str | None = None
    """A tool message's: the id of the call whose result it carries."""


class FunctionDefinition(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments (an object); None: no arguments."""
    strict: bool | None = None
    """Calls chosen by tool_choice follow the schema, strict or not."""


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("str")]
    | Annotated[NamedToolChoice, Tag("NamedToolChoice")],
    # An object is read as a named choice only: its errors then name its own fields.
    Discriminator(
        lambda value: "NamedToolChoice" if isinstance(value, dict | BaseModel) else "str"
    ),
]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """vLLM's: the model continues the last message (with add_generation_prompt false)."""
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """vLLM's: the response carries the top-N logprobs of every prompt token (not streamed)."""
    tools: list[ChatTool] | None = None
    """Functions the model may call: they reach the chat template whatever tool_choice is."""
    tool_choice: ToolChoice | None = None
    """None: "auto" with tools, else "none" (OpenAI's defaults)."""
    parallel_tool_calls: bool = True
    """False: one call at most."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: extra variables for the chat template (e.g. Qwen3's `enable_thinking`),
    over the server's default_chat_template_kwargs."""
    add_special_tokens: bool = False
    """vLLM's: the tokenizer's special tokens on top of what the chat template writes
    (most templates write the BOS themselves)."""


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt as a completion takes it, or messages as a chat does."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ChatTool] | None = None
    """As a chat's: rendered into the prompt by the chat template."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """vLLM's: the model continues the last message (with add_generation_prompt false)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """As a chat's: extra variables for the chat template."""
    add_special_tokens: bool | None = None
    """As the endpoint's: None is true for a prompt, false for messages."""
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]
