"""vLLM's POST /tokenize and /detokenize: a prompt's ids as a completion or a chat would
compute them, and ids back to text."""

from __future__ import annotations

from engine.api.errors import APIError
from engine.api.protocol import DetokenizeRequest, TokenizeRequest
from engine.api.responses import DetokenizeResponse, TokenizeResponse
from engine.api.served_model import ServedModel


class TokenizationServing:
    def __init__(self, served: ServedModel) -> None:
        self.served = served

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """The ids a completion of `prompt` (or a chat of `messages`) would compute."""
        served = self.served
        served.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError(
                "give either prompt (tokenized as a completion's) or messages (as a chat's)",
                param="prompt",
            )
        special = request.add_special_tokens
        if request.messages is not None:
            ids = await served.apply_chat_template(request, bool(special))
        elif served.tokenizer is None:
            raise APIError("this model has no tokenizer", param="prompt")
        else:
            ids = await served.encode(request.prompt, special is not False)
        strs = served.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=served.max_model_len, tokens=ids, token_strs=strs
        )

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.served.check_model(request.model)
        tokenizer = self.served.tokenizer
        if tokenizer is None:
            raise APIError("this model has no tokenizer", param="tokens")
        size = len(tokenizer)
        bad = [t for t in request.tokens if not 0 <= t < size]
        if bad:
            raise APIError(
                f"tokens: token id {bad[0]} is out of the tokenizer's range [0, {size})",
                param="tokens",
            )
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))
