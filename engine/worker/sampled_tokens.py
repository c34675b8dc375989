"""A step's sampled tokens on both sides: on the device, where the next step reads them
before the host has them (`SamplesInFlight`), and on their way to the host
(`PendingRunnerOutput`).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.core.scheduler_output import ModelRunnerOutput
from engine.worker.host_staging import HostToDevice, to_host_async
from engine.worker.request_states import CachedRequestState
from engine.worker.sampler import finish_sampling, token_logprobs_of


class SamplesInFlight:
    """The last sampling step's ids, left on the device, and the row of each request's."""

    def __init__(self):
        self.tokens: torch.Tensor | None = None
        self.rows: dict[str, int] = {}

    def record(self, sampled: torch.Tensor | None, req_ids: list[str]) -> None:
        self.tokens = sampled
        self.rows = {r: i for i, r in enumerate(req_ids)}

    def feed(self, input_ids: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Copy the in-flight tokens a step's inputs lack into their rows: `rows` is
        BatchInputs.pending_token_rows."""
        dst, src = rows
        input_ids[dst] = self.tokens[src]

    def count_into(
        self,
        counts: torch.Tensor,
        states: list[CachedRequestState],
        num_pending: list[int],
        h2d: HostToDevice,
    ) -> None:
        """Add each row's in-flight token (the previous step's sample, still on the device)
        to its output-token counts, so penalties see every token without waiting for it."""
        rows = [i for i, n in enumerate(num_pending) if n]
        if not rows:
            return
        if any(num_pending[i] > 1 for i in rows):
            raise RuntimeError("a request has more than one sampled token in flight")
        src = [self.rows[states[i].req_id] for i in rows]
        tokens = self.tokens[h2d(np.array(src, dtype=np.int64))]
        row_index = h2d(np.array(rows, dtype=np.int64))
        ones = torch.ones(len(rows), dtype=counts.dtype, device=counts.device)
        counts.index_put_((row_index, tokens), ones, accumulate=True)


class PendingRunnerOutput:
    """Sampled tokens (and logprobs) of a launched step; the copy to the host starts at once,
    so reading them waits for this step alone, not for steps launched after it."""

    def __init__(self, req_ids, sampled, logprobs, sampling_batch, output=None, prompt=()):
        self._output = output
        if output is not None:
            return
        self._req_ids = req_ids
        self._batch = sampling_batch
        self._sampled = None if sampled is None else to_host_async(sampled)
        self._logprobs = None if logprobs is None else logprobs.to_host()
        self._prompt = [(rid, first, ids, t.to_host()) for rid, first, ids, t in prompt]
        self._event = None
        device = sampled if sampled is not None else prompt[0][3].sampled
        if device.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    @classmethod
    def done(cls, output: ModelRunnerOutput) -> PendingRunnerOutput:
        return cls(None, None, None, None, output=output)

    def result(self) -> ModelRunnerOutput:
        if self._output is not None:
            return self._output
        if self._event is not None:
            self._event.synchronize()
        if self._sampled is None:
            token_ids, logprobs = [], ()
        elif self._logprobs is None:
            token_ids, logprobs = self._sampled.tolist(), ()
        else:
            res = finish_sampling(self._sampled, self._logprobs, self._batch)
            token_ids, logprobs = res.token_ids, res.logprobs
        output = ModelRunnerOutput(sampled_token_ids=dict(zip(self._req_ids, token_ids)))
        for req_id, lp in zip(self._req_ids, logprobs):
            if lp is not None:
                output.logprobs[req_id] = lp
        for req_id, first, ids, tensors in self._prompt:
            entries = token_logprobs_of(tensors, ids)
            if req_id in output.prompt_logprobs:  # a further slice of the same prompt
                output.prompt_logprobs[req_id][1].extend(entries)
            else:
                output.prompt_logprobs[req_id] = (first, entries)
        self._output = output
        return output
