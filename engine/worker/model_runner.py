"""Runs one scheduled step on this rank: its inputs to the device, the model, the sampler.

Beside it: the request states kept from the scheduler's diffs (request_states.py), a step's
input tensors (step_inputs.py), the KV memory (kv_memory.py), the CUDA-graph holders
(cuda_graphs.py, piecewise_graphs.py) and the sampled tokens on their way to the next step
and to the host (sampled_tokens.py).
"""

from __future__ import annotations

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
from engine.forward_context import forward_context
from engine.generation_config import config_eos_token_id
from engine.layers.attention import attention_layers, bind_kv_caches
from engine.worker.block_copy import copy_blocks
from engine.worker.cuda_graphs import DecodeCudaGraphs
from engine.worker.host_staging import HostToDevice
from engine.worker.kv_memory import (
    allocate_kv_caches,
    kv_block_bytes,
    kv_cache_torch_dtype,
    non_torch_bytes,
    num_gpu_blocks,
    profile_batch,
)
from engine.worker.kv_swap import KVSwapSpace, create_swap_space, swap_space_info
from engine.worker.loader import ModelSource
from engine.worker.piecewise_graphs import PiecewiseCudaGraphs
from engine.worker.request_states import CachedRequestState, RequestStates
from engine.worker.sampled_tokens import PendingRunnerOutput, SamplesInFlight
from engine.worker.sampler import (
    LogprobTensors,
    SamplingBatch,
    build_sampling_batch,
    prompt_logprob_tensors,
    sample_on_device,
)
from engine.worker.step_inputs import BatchInputs, build_batch_inputs
from engine.worker.weight_lifecycle import WeightLifecycle
from kernels import use_triton

INTERMEDIATE_KEYS = ["hidden_states", "residual"]

# Float32 logits computed at once for prompt logprobs (their log-softmax takes as much
# again): 128 rows of a 128k-token vocabulary. The step's forward has freed its activations
# by then, and the KV cache was sized for a forward's peak, far above this.
PROMPT_LOGPROB_BYTES = 64 << 20


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
        self.kv_cache_dtype = kv_cache_torch_dtype(
            config.cache_config.kv_cache_dtype, self.dtype, device
        )
        self.block_size = config.cache_config.block_size
        self.requests = RequestStates(device)
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.kv_swap: KVSwapSpace | None = None
        """The CPU pool of swap_space (engine/worker/kv_swap.py); None without one."""
        self.cuda_graphs: DecodeCudaGraphs | None = None
        self.piecewise_graphs: PiecewiseCudaGraphs | None = None
        self._in_flight = SamplesInFlight()
        self.weights = WeightLifecycle(self)
        """Weights switched in place, sleep and wake, the weight cache (weight_lifecycle.py)."""
        self._h2d = HostToDevice(device)
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
            self._non_torch_at_start = non_torch_bytes(self.device)
        self.model = self.weights.load(source)

    def determine_num_blocks(self) -> int:
        cache = self.config.cache_config
        if cache.num_gpu_blocks is not None:
            return cache.num_gpu_blocks
        block_bytes = kv_block_bytes(self.model, self.block_size, self.kv_cache_dtype)
        if self.device.type == "cpu":
            return max(2, int(cache.cpu_kv_cache_gib * (1 << 30)) // block_bytes)
        return num_gpu_blocks(
            self.device,
            self._profile_run,
            block_bytes,
            cache.gpu_memory_utilization,
            self._non_torch_at_start,
            self.config.scheduler_config.max_num_batched_tokens,
        )

    def _profile_run(self) -> None:
        """A forward over a full token budget of whole prompts (attention without a cache)."""
        sched = self.config.scheduler_config
        num_tokens = sched.max_num_batched_tokens
        input_ids, positions, meta, last_rows = profile_batch(
            num_tokens, sched.max_model_len, self.device
        )
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
                self.model.compute_logits(hidden[last_rows])

    def init_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(
            self.model, num_blocks, self.block_size, self.kv_cache_dtype, self.device
        )
        bind_kv_caches(self.model, self.kv_caches)
        self.kv_swap = create_swap_space(self.kv_caches, self.config.cache_config.swap_space)
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
                self.piecewise_graphs = PiecewiseCudaGraphs(self.model, max_tokens, self.dtype)
                self.piecewise_graphs.capture()
        elif use_triton(self.kv_caches[0]):
            from kernels import warm_up_decode

            layer = attention_layers(self.model)[0]
            warm_up_decode(self.kv_caches[0], layer.num_heads, layer.scale, self.dtype)

    def free_kv_cache(self) -> int:
        """Drop the KV tensors, the CPU pool and the CUDA graphs captured over them (sleep, or
        a model torn down); returns the blocks there were, for init_kv_cache on wake-up."""
        num_blocks = self.kv_caches[0].shape[1] if self.kv_caches else 0
        if self.model is not None:
            bind_kv_caches(self.model, [None] * len(attention_layers(self.model)))
        self.kv_caches = []
        self.kv_swap = self.cuda_graphs = self.piecewise_graphs = None
        return num_blocks

    def kv_swap_info(self) -> dict[str, float] | None:
        """The CPU pool's blocks and, for preemption_mode="auto", its measured copy and
        prefill rates (engine/worker/kv_swap.py); None without a pool."""
        if self.kv_swap is None:
            return None
        sched = self.config.scheduler_config
        whole_model = self.is_first_stage and self.is_last_stage
        return swap_space_info(
            self.kv_swap,
            self.block_size,
            self.kv_caches[0].shape[1],
            measure=sched.preemption_mode == "auto",
            model=self.model if whole_model else None,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=sched.max_model_len,
        )

    # -- one step -------------------------------------------------------------------------

    def prepare_inputs(self, out: SchedulerOutput) -> BatchInputs:
        self._h2d.next_step()
        return build_batch_inputs(
            out, self.requests, self._in_flight.rows, self._h2d, self.block_size
        )

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(out).result()

    @torch.inference_mode()
    def execute_model_async(self, out: SchedulerOutput) -> PendingRunnerOutput:
        """Launch the step and return at once; `.result()` waits for the sampled tokens."""
        if self.kv_swap is not None:
            self.kv_swap.apply(out.kv_copies_out, out.kv_copies_in)
        self.requests.update(out)
        if out.blocks_to_copy:
            copy_blocks(self.kv_caches, out.blocks_to_copy)
        if out.is_empty:
            return PendingRunnerOutput.done(ModelRunnerOutput())
        batch = self.prepare_inputs(out)
        if batch.pending_token_rows is not None:
            self._in_flight.feed(batch.input_ids, batch.pending_token_rows)
        hidden = self._forward(out, batch)
        if not self.is_last_stage:
            send_intermediate_tensors(hidden)
            return PendingRunnerOutput.done(ModelRunnerOutput())
        prompt = self._prompt_logprobs(out, hidden)
        if not batch.sampling_req_ids:
            if prompt and self.is_driver:
                return PendingRunnerOutput([], None, None, None, prompt=prompt)
            return PendingRunnerOutput.done(ModelRunnerOutput())
        return self._sample(out, batch, hidden, prompt)

    def _forward(self, out: SchedulerOutput, batch: BatchInputs) -> torch.Tensor:
        """This stage's hidden states: through a CUDA graph where one fits the step."""
        meta = batch.attn_metadata
        graphs = self.cuda_graphs
        if graphs and graphs.can_run(
            len(out.num_scheduled_tokens), meta.max_query_len, meta.block_tables.shape[1]
        ):
            return graphs.run(batch.input_ids, batch.positions, meta)
        if self._piecewise_can_run(out.total_num_scheduled_tokens):
            return self.piecewise_graphs.run(batch.input_ids, batch.positions, meta)
        intermediate = None
        if not self.is_first_stage:
            shape = (out.total_num_scheduled_tokens, self.hf_config.hidden_size)
            intermediate = recv_intermediate_tensors(
                INTERMEDIATE_KEYS, shape, self.dtype, self.device
            )
        with forward_context(meta):
            return self.model(batch.input_ids, batch.positions, intermediate)

    def _sample(
        self,
        out: SchedulerOutput,
        batch: BatchInputs,
        hidden: torch.Tensor,
        prompt: list[tuple[str, int, list[int], LogprobTensors]],
    ) -> PendingRunnerOutput:
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
            sampling_batch = self._sampling_batch(out, batch, states, num_outputs, logits.shape[-1])
            if sampling_batch.output_token_counts is not None:
                self._in_flight.count_into(
                    sampling_batch.output_token_counts, states, num_pending, self._h2d
                )
            sampled, logprobs = sample_on_device(logits, sampling_batch)
        elif self.shares_samples:
            sampled = torch.empty(len(states), dtype=torch.long, device=self.device)
        if self.shares_samples:
            tensor_model_parallel_broadcast(sampled)
        self._in_flight.record(sampled, batch.sampling_req_ids)
        if not self.is_driver:
            return PendingRunnerOutput.done(ModelRunnerOutput())
        return PendingRunnerOutput(
            batch.sampling_req_ids, sampled, logprobs, sampling_batch, prompt=prompt
        )

    def _sampling_batch(
        self,
        out: SchedulerOutput,
        batch: BatchInputs,
        states: list[CachedRequestState],
        num_outputs: list[int],
        vocab_size: int,
    ) -> SamplingBatch:
        params = [s.sampling_params for s in states]
        # Copies of every request's tokens cost O(length) a step: only when sampling
        # reads them.
        history = any(p.reads_token_history for p in params)
        no_tokens: list[int] = []
        return build_sampling_batch(
            params=params,
            prompt_token_ids=[s.prompt_token_ids if history else no_tokens for s in states],
            output_token_ids=[s.output_token_ids if history else no_tokens for s in states],
            generators=[s.generator for s in states],
            eos_token_id=self.eos_token_id,
            vocab_size=vocab_size,
            device=self.device,
            num_output_tokens=num_outputs,
            token_bitmasks=[out.grammar_bitmask.get(r) for r in batch.sampling_req_ids]
            if out.grammar_bitmask
            else None,
        )

    def _prompt_logprobs(
        self, out: SchedulerOutput, hidden: torch.Tensor
    ) -> list[tuple[str, int, list[int], LogprobTensors]]:
        """Logprobs of the prompt tokens this step's rows predict, for the requests that asked
        (SamplingParams.prompt_logprobs): row p's logits give prompt token p + 1. Each entry:
        (req id, position of its first token, the tokens, their tensors on the device).
        Every tensor-parallel rank joins (the LM head gathers across ranks)."""
        found = []
        if not self.requests.wants_prompt_logprobs:
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
