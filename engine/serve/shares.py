"""What one request may cost, decided from its fields before anything is built for it."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from engine.config import SamplingParams
from engine.serve.protocol import ApiError, SamplingFields

# logit_bias keys as OpenAI sends them: plain ASCII digits, no sign, no leading zeros, so two
# keys never name the same token ("7", "07" and "٧" would all parse to 7)
CANONICAL_TOKEN_ID = re.compile(r"(0|[1-9][0-9]{0,18})\Z", re.ASCII)


@dataclass(frozen=True)
class RequestShare:
    """The most one request may ask for; `describe` names them for `serve --help` and the docs."""

    max_n: int = 128
    max_choices: int = 256  # prompts of a batch × n
    max_stop_strings: int = 64
    max_stop_chars: int = 4096  # all stop strings together
    max_logit_bias: int = 1024  # keys
    max_logprob_entries: int = 1 << 18  # (logprobs + 1) × n × (tokens scored): the answer size

    def describe(self) -> str:
        return (f"n <= {self.max_n}; prompts x n <= {self.max_choices}; stop: <= "
                f"{self.max_stop_strings} strings of <= {self.max_stop_chars} characters in "
                f"all; logit_bias: <= {self.max_logit_bias} keys, each a token id in plain "
                f"digits, bias in [-100, 100]; logprob entries ((logprobs + 1) x n x tokens "
                f"scored, prompt included with echo) <= {self.max_logprob_entries}")

    def check_fields(self, body: SamplingFields, prompts: int) -> None:
        """ApiError(400) naming the limit, from the body's fields alone: nothing built yet."""
        n = 1 if body.n is None else body.n
        if n < 1:
            raise ApiError(400, "'n' must be at least 1", param="n")
        if n > self.max_n:
            raise ApiError(400, f"'n' must be at most {self.max_n} (the server's limit of "
                                "choices per prompt); send several requests for more",
                           param="n")
        if prompts * n > self.max_choices:
            raise ApiError(400, f"{prompts} prompts x n={n} asks for {prompts * n} choices; "
                                f"the limit is {self.max_choices} a request: split the batch",
                           param="prompt")
        stops = body.stop_strings()
        if len(stops) > self.max_stop_strings:
            raise ApiError(400, f"'stop' holds {len(stops)} strings; the limit is "
                                f"{self.max_stop_strings}", param="stop")
        if sum(map(len, stops)) > self.max_stop_chars:
            raise ApiError(400, f"'stop' strings hold more than {self.max_stop_chars} "
                                "characters together; send shorter ones", param="stop")
        bias = body.logit_bias or {}
        if len(bias) > self.max_logit_bias:
            raise ApiError(400, f"'logit_bias' has {len(bias)} keys; the limit is "
                                f"{self.max_logit_bias}", param="logit_bias")
        bad = next((key for key in bias if not CANONICAL_TOKEN_ID.match(key)), None)
        if bad is not None:
            raise ApiError(400, f"'logit_bias' keys must be token ids in plain ASCII digits "
                                f"without leading zeros, got {bad[:32]!r}", param="logit_bias")

    def check_logprobs(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int,
                       max_model_len: int) -> None:
        """ApiError(400) when the logprobs asked for would exceed the answer's share."""
        generated = min(params.max_tokens, max_model_len)
        entries = 0
        for prompt in prompts:
            if params.logprobs is not None:
                entries += n * (params.logprobs + 1) * generated
            if params.prompt_logprobs is not None:
                entries += n * (params.prompt_logprobs + 1) * len(prompt)
        if entries > self.max_logprob_entries:
            raise ApiError(400, f"the logprobs asked for come to {entries} entries ((logprobs "
                                f"+ 1) x n x tokens scored); the limit is "
                                f"{self.max_logprob_entries}: ask for fewer logprobs, choices "
                                "or tokens", param="logprobs")
