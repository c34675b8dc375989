"""Turns one scheduled step into flat tensors, runs the model and samples.

The runner keeps a copy of every scheduled request's tokens and block table; the
scheduler sends new requests in full and running ones as diffs (engine/core/scheduler_output.py).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import EngineConfig
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.distributed import (
    get_pp_rank,
    get_pp_size,
    get_tp_rank,
    get_tp_size,
    recv_intermediate_tensors,
    send_intermediate_tensors,
    sequence_parallel_enabled,
    tensor_model_parallel_broadcast,
)
from engine.forward_context import AttentionMetadata, forward_context
from engine.generation_config import config_eos_token_id
from engine.layers.attention import attention_layers, bind_kv_caches
from engine.sampling_params import SamplingParams
from engine.worker.cuda_graphs import DecodeCudaGraphs
from engine.worker.host_staging import HostToDevice, to_host_async
from engine.worker.loader import ModelSource, load_model
from engine.worker.piecewise_graphs import PiecewiseCudaGraphs
from engine.worker.sampler import (
    LogprobTensors,
    build_sampling_batch,
    finish_sampling,
    prompt_logprob_tensors,
    sample_on_device,
    token_logprobs_of,
)
from kernels import use_triton


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    num_pending: int = 0
    """Tokens this runner sampled that have not come back in a diff yet (at most 2 with a
    step in flight); the newest is read from the previous step's device-side samples."""

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    """Row of the hidden states whose logits are sampled, one per sampling request."""
    sampling_req_ids: list[str] = field(default_factory=list)
    pending_token_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows of input_ids, rows of the previous step's samples) for tokens the host has not
    seen yet: copied on the device, so scheduling need not wait for the last step."""


INTERMEDIATE_KEYS = ["hidden_states", "residual"]


class ModelRunner:
    """Build after `init_distributed`: the rank's pipeline stage decides what it runs.

    Every stage keeps the same request states; the first embeds tokens, the others receive
    the previous stage's hidden states and residual, the last computes logits. Only the
    last stage's tensor-parallel rank 0 samples and returns tokens; other ranks return an
    empty `ModelRunnerOutput`.
    """

    def __init__(self, config: EngineConfig, hf_config, device: torch.device):
        self.config = config
        self.hf_config = hf_config
        self.device = device
        self.dtype = config.model.torch_dtype
        self.block_size = config.cache_config.block_size
        self.requests: dict[str, CachedRequestState] = {}
        self._wants_prompt_logprobs: set[str] = set()
        """Requests with SamplingParams.prompt_logprobs (the others skip that work)."""
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.cuda_graphs: DecodeCudaGraphs | None = None
        self.piecewise_graphs: PiecewiseCudaGraphs | None = None
        self._prev_samples: torch.Tensor | None = None
        self._h2d = HostToDevice(device)
        self._prev_sample_rows: dict[str, int] = {}
        self.eos_token_id: int | None = config_eos_token_id(hf_config)
        self.is_first_stage = get_pp_rank() == 0
        self.is_last_stage = get_pp_rank() == get_pp_size() - 1
        self.is_driver = self.is_last_stage and get_tp_rank() == 0
        self.shares_samples = get_tp_size() > 1 and get_pp_size() == 1
        """Every tensor-parallel rank gets the driver's samples on the device, so that each
        can feed a decode its previous token itself (overlapped steps)."""

    # -- set-up ---------------------------------------------------------------------------

    def load_model(self, source: ModelSource) -> None:
        if self.device.type == "cuda":
            self._non_torch_at_start = _non_torch_bytes(self.device)
        self.model = load_model(
            source,
            self.hf_config,
            self.dtype,
            self.device,
            seed=self.config.model.seed,
            max_model_len=self.config.scheduler_config.max_model_len,
        )

    def kv_block_bytes(self) -> int:
        """Bytes of one KV block across all of this rank's layers."""
        layers = attention_layers(self.model)
        first = layers[0]
        per_layer = 2 * self.block_size * first.num_kv_heads * first.head_dim
        return per_layer * len(layers) * torch.tensor([], dtype=self.dtype).element_size()

    def determine_num_blocks(self) -> int:
        cache = self.config.cache_config
        if cache.num_gpu_blocks is not None:
            return cache.num_gpu_blocks
        if self.device.type == "cpu":
            return max(2, int(cache.cpu_kv_cache_gib * (1 << 30)) // self.kv_block_bytes())
        return self._profile_num_gpu_blocks()

    def _profile_num_gpu_blocks(self) -> int:
        """Run a forward at the full token budget, then give what is left of the budget to KV.

        The budget (gpu_memory_utilization x the card) is this process's: memory other
        processes hold counts only if it leaves too little free for the budget.
        """
        gc.collect()  # an engine dropped in a reference cycle still holds its KV cache
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        # CUDA/NCCL memory outside torch's allocator that this process took since loading.
        non_torch = max(_non_torch_bytes(self.device) - self._non_torch_at_start, 0)
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.config.cache_config.gpu_memory_utilization
        available = budget - peak - non_torch
        num_blocks = int(available // self.kv_block_bytes())
        if num_blocks < 2:
            raise ValueError(
                f"no memory left for the KV cache: the model and a {self.config.scheduler_config.max_num_batched_tokens}"
                f"-token forward take {peak / 2**30:.1f} GiB of the "
                f"{budget / 2**30:.1f} GiB allowed by gpu_memory_utilization"
            )
        # The KV cache comes from free memory plus what the allocator holds unused.
        room = (
            free
            + torch.cuda.memory_reserved(self.device)
            - torch.cuda.memory_allocated(self.device)
        )
        if available > room:
            raise ValueError(
                f"gpu_memory_utilization={self.config.cache_config.gpu_memory_utilization} "
                f"asks for {budget / 2**30:.1f} GiB of the card, but other processes leave "
                f"room for only {room / 2**30:.1f} GiB of KV cache: lower gpu_memory_utilization"
            )
        return num_blocks

    def _profile_run(self) -> None:
        """A forward over a full token budget of whole prompts (attention without a cache)."""
        num_tokens = self.config.scheduler_config.max_num_batched_tokens
        seq_len = min(num_tokens, self.config.scheduler_config.max_model_len - 1)
        lens = [seq_len] * (num_tokens // seq_len)
        if num_tokens % seq_len:
            lens.append(num_tokens % seq_len)
        starts = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=self.device),
            query_start_loc=starts.to(self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(len(lens), 1, dtype=torch.int32, device=self.device),
            max_query_len=max(lens),
            max_seq_len=max(lens),
        )
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        intermediate = None
        if not self.is_first_stage:
            # Each stage profiles alone: a stand-in for the previous stage's hand-off.
            shape = (num_tokens, self.hf_config.hidden_size)
            intermediate = {
                k: torch.zeros(shape, dtype=self.dtype, device=self.device)
                for k in INTERMEDIATE_KEYS
            }
        with torch.inference_mode(), forward_context(meta):
            hidden = self.model(input_ids, positions, intermediate)
            if self.is_last_stage:
                self.model.compute_logits(hidden[starts[1:].long().to(self.device) - 1])

    def init_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = [
            torch.zeros(
                2,
                num_blocks,
                self.block_size,
                layer.num_kv_heads,
                layer.head_dim,
                dtype=self.dtype,
                device=self.device,
            )
            for layer in attention_layers(self.model)
        ]
        bind_kv_caches(self.model, self.kv_caches)
        # Graphs capture a whole-model forward: pipeline stages run eagerly.
        use_graphs = self.config.parallel_config.pipeline_parallel_size == 1
        if self.device.type == "cuda" and not self.config.enforce_eager and use_graphs:
            sched = self.config.scheduler_config
            self.cuda_graphs = DecodeCudaGraphs(
                self.model,
                max_num_seqs=sched.max_num_seqs,
                max_blocks_per_seq=-(-sched.max_model_len // self.block_size),
                max_model_len=sched.max_model_len,
                hidden_size=self.hf_config.hidden_size,
                dtype=self.dtype,
                device=self.device,
            )
            self.cuda_graphs.capture()
            max_tokens = min(self.config.prefill_cuda_graph_tokens, sched.max_num_batched_tokens)
            if max_tokens > 0:
                self.piecewise_graphs = PiecewiseCudaGraphs(self.model, max_tokens)
                self.piecewise_graphs.capture()
        elif use_triton(self.kv_caches[0]):
            from kernels.triton_attention import warm_up_decode

            layer = attention_layers(self.model)[0]
            warm_up_decode(self.kv_caches[0], layer.num_heads, layer.scale)

    # -- one step -------------------------------------------------------------------------

    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
            self._wants_prompt_logprobs.discard(req_id)
        for new in out.scheduled_new_reqs:
            params = new.sampling_params
            if params.prompt_logprobs is not None:
                self._wants_prompt_logprobs.add(new.req_id)
            generator = None
            if params.seed is not None:  # seeded before each draw (sampling_batch.token_seed)
                generator = torch.Generator(device=self.device)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=generator,
            )
        for cached in out.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            state.num_pending = max(0, state.num_pending - len(cached.new_token_ids))
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def prepare_inputs(self, out: SchedulerOutput) -> BatchInputs:
        self._h2d.next_step()
        bs = self.block_size
        num_reqs = len(out.num_scheduled_tokens)
        num_tokens = out.total_num_scheduled_tokens
        input_ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        slots = np.empty(num_tokens, dtype=np.int64)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        seq_lens = np.empty(num_reqs, dtype=np.int32)
        states = [self.requests[r] for r in out.num_scheduled_tokens]
        width = max(len(s.block_ids) for s in states)
        block_tables = np.zeros((num_reqs, width), dtype=np.int32)
        logits_indices: list[int] = []
        sampling_req_ids: list[str] = []
        pending_dst: list[int] = []
        pending_src: list[int] = []
        offset = 0
        num_decodes = 0  # requests at the front with one token each
        for i, (state, n) in enumerate(zip(states, out.num_scheduled_tokens.values())):
            if n == 1 and num_decodes == i:
                num_decodes += 1
            start = state.num_computed_tokens
            end = start + n
            blocks = state.block_ids
            block_tables[i, : len(blocks)] = blocks
            num_known = len(state.token_ids)
            if end > num_known:
                # The last input token was sampled by the step before and is still on the device.
                if end != num_known + 1 or state.req_id not in self._prev_sample_rows:
                    raise RuntimeError(f"request {state.req_id}: input tokens are missing")
                pending_dst.append(offset + n - 1)
                pending_src.append(self._prev_sample_rows[state.req_id])
                end_known = num_known
            else:
                end_known = end
            if n == 1:
                input_ids[offset] = state.token_ids[start] if end_known > start else 0
                positions[offset] = start
                slots[offset] = blocks[start // bs] * bs + start % bs
            else:
                pos = np.arange(start, end)
                input_ids[offset : offset + end_known - start] = state.token_ids[start:end_known]
                positions[offset : offset + n] = pos
                slots[offset : offset + n] = block_tables[i, pos // bs] * bs + pos % bs
            offset += n
            query_start_loc[i + 1] = offset
            seq_lens[i] = end
            if end == num_known + state.num_pending:
                logits_indices.append(offset - 1)
                sampling_req_ids.append(state.req_id)

        meta = AttentionMetadata(
            slot_mapping=self._h2d(slots),
            query_start_loc=self._h2d(query_start_loc),
            seq_lens=self._h2d(seq_lens),
            block_tables=self._h2d(block_tables),
            max_query_len=max(out.num_scheduled_tokens.values()),
            max_seq_len=int(seq_lens.max()),
            num_decodes=num_decodes,
        )
        return BatchInputs(
            input_ids=self._h2d(input_ids),
            positions=self._h2d(positions),
            attn_metadata=meta,
            logits_indices=self._h2d(np.array(logits_indices, dtype=np.int64)),
            sampling_req_ids=sampling_req_ids,
            pending_token_rows=(
                (
                    self._h2d(np.array(pending_dst, dtype=np.int64)),
                    self._h2d(np.array(pending_src, dtype=np.int64)),
                )
                if pending_dst
                else None
            ),
        )

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(out).result()

    @torch.inference_mode()
    def execute_model_async(self, out: SchedulerOutput) -> PendingRunnerOutput:
        """Launch the step and return at once; `.result()` waits for the sampled tokens."""
        self._update_states(out)
        if out.is_empty:
            return PendingRunnerOutput.done(ModelRunnerOutput())
        batch = self.prepare_inputs(out)
        if batch.pending_token_rows is not None:
            dst, src = batch.pending_token_rows
            batch.input_ids[dst] = self._prev_samples[src]
        meta = batch.attn_metadata
        graphs = self.cuda_graphs
        if graphs and graphs.can_run(
            len(out.num_scheduled_tokens), meta.max_query_len, meta.block_tables.shape[1]
        ):
            hidden = graphs.run(batch.input_ids, batch.positions, meta)
        elif self._piecewise_can_run(out.total_num_scheduled_tokens):
            hidden = self.piecewise_graphs.run(batch.input_ids, batch.positions, meta)
        else:
            intermediate = None
            if not self.is_first_stage:
                shape = (out.total_num_scheduled_tokens, self.hf_config.hidden_size)
                intermediate = recv_intermediate_tensors(
                    INTERMEDIATE_KEYS, shape, self.dtype, self.device
                )
            with forward_context(meta):
                hidden = self.model(batch.input_ids, batch.positions, intermediate)
        if not self.is_last_stage:
            send_intermediate_tensors(hidden)
            return PendingRunnerOutput.done(ModelRunnerOutput())
        prompt = self._prompt_logprobs(out, hidden)
        if not batch.sampling_req_ids:
            if prompt and self.is_driver:
                return PendingRunnerOutput([], None, None, None, prompt=prompt)
            return PendingRunnerOutput.done(ModelRunnerOutput())
        # Every tensor-parallel rank joins the logits all-gather; only the driver samples.
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        states = [self.requests[r] for r in batch.sampling_req_ids]
        # Generated before this step's sample: known to the host, plus those in flight.
        num_pending = [s.num_pending for s in states]
        num_outputs = [
            len(s.token_ids) - s.num_prompt_tokens + n for s, n in zip(states, num_pending)
        ]
        for state in states:
            state.num_pending += 1
        sampled = sampling_batch = logprobs = None
        if self.is_driver:
            params = [s.sampling_params for s in states]
            # Copies of every request's tokens cost O(length) a step: only when sampling
            # reads them.
            history = any(p.reads_token_history for p in params)
            no_tokens: list[int] = []
            sampling_batch = build_sampling_batch(
                params=params,
                prompt_token_ids=[s.prompt_token_ids if history else no_tokens for s in states],
                output_token_ids=[s.output_token_ids if history else no_tokens for s in states],
                generators=[s.generator for s in states],
                eos_token_id=self.eos_token_id,
                vocab_size=logits.shape[-1],
                device=self.device,
                num_output_tokens=num_outputs,
                token_bitmasks=[out.grammar_bitmask.get(r) for r in batch.sampling_req_ids]
                if out.grammar_bitmask
                else None,
            )
            if sampling_batch.output_token_counts is not None:
                self._count_pending_tokens(sampling_batch.output_token_counts, states, num_pending)
            sampled, logprobs = sample_on_device(logits, sampling_batch)
        elif self.shares_samples:
            sampled = torch.empty(len(states), dtype=torch.long, device=self.device)
        if self.shares_samples:
            tensor_model_parallel_broadcast(sampled)
        self._prev_samples = sampled
        self._prev_sample_rows = {r: i for i, r in enumerate(batch.sampling_req_ids)}
        if not self.is_driver:
            return PendingRunnerOutput.done(ModelRunnerOutput())
        return PendingRunnerOutput(
            batch.sampling_req_ids, sampled, logprobs, sampling_batch, prompt=prompt
        )

    def _prompt_logprobs(
        self, out: SchedulerOutput, hidden: torch.Tensor
    ) -> list[tuple[str, int, list[int], LogprobTensors]]:
        """Logprobs of the prompt tokens this step's rows predict, for the requests that asked
        (SamplingParams.prompt_logprobs): row p's logits give prompt token p + 1. Each entry:
        (req id, position of its first token, the tokens, their tensors on the device).
        Every tensor-parallel rank joins (the LM head gathers across ranks)."""
        found = []
        if not self._wants_prompt_logprobs:
            return found
        slice_rows = max(16, PROMPT_LOGPROB_BYTES // (4 * self.hf_config.vocab_size))
        offset = 0
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.requests[req_id]
            num = state.sampling_params.prompt_logprobs
            start = state.num_computed_tokens
            # The last prompt row samples the first output token: not a prompt logprob.
            end = min(start + n, state.num_prompt_tokens - 1)
            if num is not None and end > start:
                for first in range(start, end, slice_rows):
                    last = min(end, first + slice_rows)
                    rows = self._h2d(np.arange(offset + first - start, offset + last - start))
                    targets = state.token_ids[first + 1 : last + 1]
                    logits = self.model.compute_logits(hidden[rows])
                    if self.is_driver:
                        target_ids = self._h2d(np.array(targets, dtype=np.int64))
                        tensors = prompt_logprob_tensors(logits, target_ids, num)
                        found.append((req_id, first + 1, targets, tensors))
            offset += n
        return found

    def _piecewise_can_run(self, num_tokens: int) -> bool:
        graphs = self.piecewise_graphs
        # A sequence-parallel step splits rows across ranks, which the graphs do not.
        return (
            graphs is not None
            and graphs.can_run(num_tokens)
            and not sequence_parallel_enabled(num_tokens)
        )

    def _count_pending_tokens(
        self, counts: torch.Tensor, states: list[CachedRequestState], num_pending: list[int]
    ) -> None:
        """Add each row's in-flight token (the previous step's sample, still on the device)
        to its output-token counts, so penalties see every token without waiting for it."""
        rows = [i for i, n in enumerate(num_pending) if n]
        if not rows:
            return
        if any(num_pending[i] > 1 for i in rows):
            raise RuntimeError("a request has more than one sampled token in flight")
        src = [self._prev_sample_rows[states[i].req_id] for i in rows]
        tokens = self._prev_samples[self._h2d(np.array(src, dtype=np.int64))]
        row_index = self._h2d(np.array(rows, dtype=np.int64))
        ones = torch.ones(len(rows), dtype=counts.dtype, device=counts.device)
        counts.index_put_((row_index, tokens), ones, accumulate=True)


# Float32 logits computed at once for prompt logprobs (their log-softmax takes as much
# again): 128 rows of a 128k-token vocabulary. The step's forward has freed its activations
# by then, and the KV cache was sized for a forward's peak, far above this.
PROMPT_LOGPROB_BYTES = 64 << 20


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


def _non_torch_bytes(device: torch.device) -> int:
    """Device memory in use that torch's allocator did not hand out (all processes)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)
