"""Frozen engine configs, named after vLLM's engine arguments.

`EngineArgs` holds the flat engine arguments as given (vLLM's spelling); its
`create_engine_config()` resolves the "auto" values once into a frozen `EngineConfig`, and
nothing mutates a config afterwards. Importing this module loads no torch (the Serve app's keys
and `kvray serve --help` are built from these classes): torch loads where a value needs it.

Longer than most modules: every engine key lives here with its doc (docs/configuration.md is
drawn from them), and a key's check sits beside its field; split, the keys would have two
homes.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    create_model,
    field_validator,
    model_validator,
)

from engine.arg_aliases import resolve_aliases
from engine.generation_config import check_setting
from engine.layers.quantization import resolve_quantization

if TYPE_CHECKING:
    import torch

DType = Literal["auto", "float32", "bfloat16", "float16", "fp8"]


class _Frozen(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", protected_namespaces=(), use_attribute_docstrings=True
    )


class ModelConfig(_Frozen):
    model: str | None = None
    """HF folder, a `.gguf` file, or a shape name with `load_format="dummy"`. None: bundled SmolLM2."""
    tokenizer: str | None = None
    """Tokenizer folder; defaults to the model's own (or the GGUF metadata)."""
    tokenizer_mode: Literal["auto", "slow"] = "auto"
    """vLLM's: auto loads the fast (Rust) tokenizer; slow asks transformers for the Python
    one, refused at start where transformers cannot give one (a GGUF file's tokenizer, or a
    transformers that builds only fast tokenizers)."""
    served_model_name: str | list[str] | None = None
    """Name in the API; defaults to the model's folder or file name. Several (vLLM's
    aliases): requests may name any, responses carry the first."""
    dtype: DType = "auto"
    """auto: the checkpoint's dtype on GPU, float32 on CPU (bf16 matmuls on a CPU are slow and
    inexact). fp8 (the guides' "FP8 mixed precision"): FP8 weights with 16-bit activations,
    the same as quantization="fp8" with dtype auto; it needs a GPU with FP8."""
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = "auto"
    quantization: Literal["auto", "none", "fp8", "compressed-tensors", "awq", "gptq", "gguf"] = (
        "auto"
    )
    """How the linear layers' weights are stored. auto: as the checkpoint's
    quantization_config says (fp8, compressed-tensors, awq, gptq), a GGUF file kept quantized
    on a GPU (dequantized on a CPU), else 16-bit; none: 16-bit (a GGUF file dequantized at
    load); fp8: FP8 W8A8, a 16-bit checkpoint quantized at load; awq / gptq with dummy
    weights: random int4 weights. Embeddings and the LM head stay 16-bit. Resolved at start
    to the method that runs."""
    max_model_len: int | None = Field(default=None, gt=0)
    """Prompt + output tokens per request; defaults to the model's max_position_embeddings."""
    seed: int = 0
    """Seed for dummy weights and for requests that give no seed of their own."""
    generation_config: str = "auto"
    """auto: the model folder's generation_config.json gives the sampling defaults of
    requests that leave them unset, their default length and more EOS ids; vllm: the
    engine's own defaults (vLLM's spelling); or a folder holding a generation_config.json."""

    @field_validator("generation_config")
    @classmethod
    def _check_generation_config(cls, value: str) -> str:
        return check_setting(value)

    @field_validator("served_model_name")
    @classmethod
    def _check_served_names(cls, value: str | list[str] | None) -> str | list[str] | None:
        return check_served_names(value)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype in ("auto", "fp8"):
            raise ValueError(
                f"dtype is still {self.dtype!r}: use EngineConfig.create() to resolve it"
            )
        import torch

        return getattr(torch, self.dtype)


def served_name_list(value: str | list[str] | None) -> list[str]:
    """The names of a served_model_name, the first the one responses carry; [] for None
    (the model's folder or file name serves)."""
    return [value] if isinstance(value, str) else list(value or [])


def check_served_names(value: str | list[str] | None) -> str | list[str] | None:
    """served_model_name as given, if every name is non-empty and none repeats."""
    names = served_name_list(value)
    if isinstance(value, list) and not names:
        raise ValueError("give at least one name")
    if any(not name for name in names):
        raise ValueError("a name must not be empty")
    if len(set(names)) != len(names):
        raise ValueError(f"{names} names one model twice")
    return value


class CacheConfig(_Frozen):
    block_size: int = Field(default=16, gt=0)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    """Fraction of the GPU's memory this process may use, KV cache included."""
    num_gpu_blocks: int | None = Field(default=None, gt=1)
    """Override the profiled number of KV blocks (block 0 is reserved as the null block)."""
    enable_prefix_caching: bool = True
    cpu_kv_cache_gib: float = Field(default=1.0, gt=0)
    """KV cache size when running on a CPU (there is nothing to profile)."""
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """auto: the model's dtype; fp8: float8_e4m3fn entries, about twice the tokens of a
    16-bit cache. Each layer stores keys / k_scale and values / v_scale, the checkpoint's
    `self_attn.k_scale` / `v_scale` (or `k_proj` / `v_proj.output_scale`), 1.0 where it has
    none. Needs a GPU of compute capability 8.9 or later; a CPU runs it through the torch
    references."""
    swap_space: float = Field(default=0, ge=0, allow_inf_nan=False)
    """GiB of pinned CPU memory per rank for KV blocks off the GPU (vLLM's name): requests
    preempted by swapping (preemption_mode) and, with enable_prefix_caching, full blocks
    evicted from the GPU's prefix cache (a second, CPU tier; swapped requests win the room).
    0: off. Refused at start when the ranks together would pin more than 70% of the host's
    memory (SWAP_SPACE_HOST_FRACTION)."""

    weight_cache_gb: float = Field(default=0, ge=0, allow_inf_nan=False)
    """GiB of host memory per rank (pinned on a GPU) that keep recently used models'
    weights: the one switched away from by `load_model`, and level-1 sleep's copy; a switch
    back or a wake-up is then a copy to the device, not a checkpoint read
    (engine/worker/weight_cache.py). Least recently used models go first. 0: off (level-1
    sleep still keeps its own copy). Refused at start when it and swap_space, all ranks
    together, would pin more than 70% of the host's memory (SWAP_SPACE_HOST_FRACTION)."""


class SchedulerConfig(_Frozen):
    max_num_seqs: int = Field(default=256, gt=0)
    max_num_batched_tokens: int = Field(default=8192, gt=0)
    """Token budget of one step; prompts longer than this are prefilled in chunks."""
    max_model_len: int = Field(default=2048, gt=0)
    policy: Literal["fcfs", "priority"] = "fcfs"
    max_prefill_tokens_with_decodes: int | None = Field(default=None, ge=0)
    """Prompt tokens a step takes while requests are decoding (a longer prompt is prefilled
    in chunks), so that an arriving prompt holds up the running streams by a bounded step.
    0 or None: up to max_num_batched_tokens. EngineArgs.create_engine_config resolves None:
    SERVER_PREFILL_TOKENS_WITH_DECODES when serving, 0 offline."""
    batch_wait_timeout_ms: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """Dynamic batching: how long new requests may be held in the queue so that more
    arrivals join their prefill step, in ms from the oldest waiting request's arrival. While
    it runs, the step admits no new request (running ones go on decoding; with none
    running the engine loop waits for arrivals instead of stepping); it ends early as soon
    as the batch is full (max_num_seqs requests, or a whole step's max_num_batched_tokens of
    prompt waiting). So no request's first token comes more than this later than without
    it. Only where requests keep arriving (a server, AsyncEngine): the offline LLM never
    waits. 0: off (engine/core/batch_wait.py). The guides' batch_timeout is this in s."""
    preemption_mode: Literal["recompute", "swap", "auto"] = "recompute"
    """How a request gives up its KV blocks when they run short: recompute frees them (its
    tokens are computed again when it resumes); swap copies them to the CPU pool
    (swap_space) and back when it resumes; auto swaps a request whose computed tokens cost
    more to recompute than to copy back (engine/core/kv_offload.py's SwapCostModel). Swap
    falls back to recompute while the CPU pool is full, and without swap_space."""


class ParallelConfig(_Frozen):
    tensor_parallel_size: int = Field(default=1, gt=0)
    pipeline_parallel_size: int = Field(default=1, gt=0)
    distributed_executor_backend: str | type | None = None
    """How the ranks run: "uni" runs the one rank in this process; a backend name registered
    under the `kvray.executors` entry points ("ray": one Ray actor per rank) or an `Executor`
    subclass (engine/executor.py) starts and drives its own workers. None: "uni" for one
    rank, "ray" for several (vLLM's setting also takes a class). A class pickles by reference,
    so engine arguments that hold one still reach an engine process."""
    sequence_parallel_min_tokens: int | None = Field(default=None, ge=0)
    """Batches of at least this many tokens run sequence-parallel across the tensor-parallel
    ranks (engine.distributed.init_sequence_parallel); None: 2048 where the GPUs reach each
    other's memory, off otherwise; 0: off."""

    @property
    def world_size(self) -> int:
        return world_size(self.tensor_parallel_size, self.pipeline_parallel_size)


def world_size(tensor_parallel_size: int | None, pipeline_parallel_size: int | None) -> int:
    """Ranks of one engine: tensor_parallel_size x pipeline_parallel_size (None counts as 1,
    as in engine arguments that leave a size out)."""
    return (tensor_parallel_size or 1) * (pipeline_parallel_size or 1)


class EngineConfig(_Frozen):
    model_config_: ModelConfig = Field(alias="model_config")
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device: Literal["cpu", "cuda"]
    enforce_eager: bool = False
    """Turn CUDA graphs off."""
    prefill_cuda_graph_tokens: int = Field(
        default=2048,
        ge=0,
        description="steps with prefills of up to this many tokens (at most "
        "max_num_batched_tokens) replay CUDA graphs split at attention; 0: eager (the "
        "default with tensor_parallel_size > 1)",
    )
    """Steps with prefills of up to this many tokens (at most max_num_batched_tokens) replay
    CUDA graphs split at attention (engine/worker/piecewise_graphs.py); 0: they run eagerly, the
    default with tensor_parallel_size > 1 (not yet run on GPUs there).
    Decode-only steps always replay whole-forward graphs unless enforce_eager. A short
    prefill's step is bound by its kernel launches, which the graphs take away (figures:
    bench/RESULTS.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @property
    def model(self) -> ModelConfig:
        return self.model_config_

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.model.dtype in ("auto", "fp8"):
            raise ValueError("dtype must be resolved before building EngineConfig")
        return self

    @classmethod
    def create(
        cls, hf_config: Any = None, usage_context: UsageContext = "offline", **engine_args: Any
    ) -> EngineConfig:
        """`EngineArgs(**engine_args).create_engine_config(hf_config, usage_context)`."""
        return EngineArgs(**engine_args).create_engine_config(hf_config, usage_context)


UsageContext = Literal["offline", "server"]

SERVER_PREFILL_TOKENS_WITH_DECODES = 1024
"""A server's max_prefill_tokens_with_decodes when not given: one long prompt a step keeps
the running streams' token gaps short, where a smaller cap would make each prompt wait a
step more for its first token (figures: bench/RESULTS.md)."""

RUNNER_ARGS = ("device", "enforce_eager", "prefill_cuda_graph_tokens")
"""Engine arguments that are EngineConfig's own fields (the rest belong to its parts)."""


def resolve_device(device: str | None) -> str:
    """The engine's device: as given, else cuda when torch sees a GPU, else cpu."""
    if not device:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return device


LARGE_GPU_BYTES = 70 * 2**30
"""GPU memory from which the engine runs vLLM's larger batch defaults."""


def default_batch_limits(
    gpu: tuple[int, str] | None, usage_context: UsageContext
) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) when not given: vLLM's defaults.

    A GPU of 70 GiB or more (other than an A100, where vLLM measured larger budgets to lose)
    runs up to 1024 sequences, with a 16,384-token step offline and 8,192 when serving
    (a smaller step keeps the decodes that share it quick); anything else 256 and 8,192.
    `gpu` is (total memory in bytes, device name), None without one.
    """
    if gpu is not None and gpu[0] >= LARGE_GPU_BYTES and "a100" not in gpu[1].lower():
        return 1024, 16384 if usage_context == "offline" else 8192
    return 256, 8192


def max_default_num_seqs(device: str | None) -> int:
    """The most sequences `default_batch_limits` lets an engine on `device` run: on CUDA a
    large GPU's. For bounds set before the engine's GPU is known (a Serve replica's)."""
    gpu = (LARGE_GPU_BYTES, "any large GPU") if device == "cuda" else None
    return default_batch_limits(gpu, "server")[0]


def _gpu_memory_and_name(device: str) -> tuple[int, str] | None:
    if device != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return props.total_memory, props.name


def _fp8_dtype_quantization(dtype: str, quantization: str, device: str) -> str:
    """The quantization key that dtype="fp8" stands for (FP8 weights, 16-bit activations);
    `quantization` as given for any other dtype."""
    if dtype != "fp8":
        return quantization
    if device != "cuda":
        raise ValueError(
            "dtype='fp8' runs FP8 weights on a GPU with FP8 (compute capability 8.9 or newer); "
            f"on {device} use dtype='auto' (float32), or quantization='fp8' to run the FP8 "
            "torch references"
        )
    if quantization not in ("auto", "fp8"):
        raise ValueError(
            f"dtype='fp8' means quantization='fp8'; it cannot go with quantization={quantization!r}"
        )
    return "fp8"


def _resolve_dtype(hf_config: Any, device: str) -> str:
    if device == "cpu":
        return "float32"
    name = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if name is not None and not isinstance(name, str):  # a torch.dtype
        name = str(name).removeprefix("torch.")
    if name in ("bfloat16", "float16"):
        return name
    return "bfloat16"


def _model_max_len(hf_config: Any) -> int | None:
    if hf_config is None:
        return None
    return getattr(hf_config, "max_position_embeddings", None)


PART_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig)
"""EngineConfig's parts; ModelConfig first: its max_model_len default (None = the model's
own) wins over SchedulerConfig's."""


def _engine_arg_fields() -> dict[str, Any]:
    """The parts' fields and EngineConfig's own (RUNNER_ARGS), with None for the values
    `create_engine_config` picks (device, batch limits, prefill graphs)."""
    fields: dict[str, Any] = {}
    for cls in PART_CONFIGS:
        for name, info in cls.model_fields.items():
            fields.setdefault(name, (info.annotation, info))
    for name in RUNNER_ARGS:
        info = EngineConfig.model_fields[name]
        fields[name] = (info.annotation, info)
    fields["device"] = (str | None, None)
    for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_cuda_graph_tokens"):
        annotation, info = fields[name]
        fields[name] = (annotation | None, Field(None, **_constraints(info)))
    return fields


def _constraints(info: Any) -> dict[str, Any]:
    """A field's gt/ge bounds, as Field() keywords."""
    return {
        name: getattr(bound, name)
        for bound in info.metadata
        for name in ("gt", "ge")
        if getattr(bound, name, None) is not None
    }


def part_field_validators() -> dict[str, Any]:
    """The parts' field validators, for a model that takes their fields flat."""
    return {
        f"_{cls.__name__}{name}": field_validator(*d.info.fields, mode=d.info.mode)(d.func)
        for cls in PART_CONFIGS
        for name, d in cls.__pydantic_decorators__.field_validators.items()
    }


_EngineArgsFields = create_model(
    "_EngineArgsFields",
    __base__=_Frozen,
    __validators__=part_field_validators(),
    **_engine_arg_fields(),
)


class EngineArgs(_EngineArgsFields):
    """The flat, vLLM-named engine arguments, as given: one frozen object that travels from
    the entry point (LLM, AsyncEngine, a Serve replica) to the engine, its process included
    (it pickles; an executor class in it pickles by reference).

    None for device, max_num_seqs, max_num_batched_tokens, max_prefill_tokens_with_decodes,
    max_model_len and prefill_cuda_graph_tokens: `create_engine_config` picks them.
    """

    def __init__(self, **engine_args: Any) -> None:
        engine_args = resolve_aliases(engine_args, type(self).model_fields)
        unknown = sorted(set(engine_args) - set(type(self).model_fields))
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        super().__init__(**engine_args)

    @field_validator("model", mode="before")
    @classmethod
    def _model_path_as_text(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @classmethod
    def of(cls, engine_args: EngineArgs | None, kwargs: dict[str, Any]) -> EngineArgs:
        """`engine_args`, or one built from keyword arguments (an entry point takes either)."""
        if engine_args is None:
            return cls(**kwargs)
        if kwargs:
            raise ValueError(f"give engine_args or {', '.join(sorted(kwargs))}, not both")
        return engine_args

    @property
    def world_size(self) -> int:
        return world_size(self.tensor_parallel_size, self.pipeline_parallel_size)

    @property
    def resolved_device(self) -> str:
        """`device` as given, else cuda when torch sees a GPU, else cpu (loads torch then)."""
        return resolve_device(self.device)

    def check_device_keys(self) -> None:
        """Refuse what this device cannot run (dtype="fp8" on a CPU) before a model loads;
        `create_engine_config` checks it again."""
        _fp8_dtype_quantization(self.dtype, self.quantization, self.resolved_device)

    def create_engine_config(
        self, hf_config: Any = None, usage_context: UsageContext = "offline"
    ) -> EngineConfig:
        """The frozen EngineConfig, with the "auto" values resolved.

        `hf_config` (a transformers config) supplies the checkpoint dtype and context length;
        `usage_context` picks the batch defaults (see `default_batch_limits`).
        """
        args = dict(self)
        device = self.resolved_device
        max_len = self._resolved_max_model_len(hf_config)
        quantization = _fp8_dtype_quantization(self.dtype, self.quantization, device)
        dtype = (
            self.dtype if self.dtype not in ("auto", "fp8") else _resolve_dtype(hf_config, device)
        )
        model_args = _fields_of(ModelConfig, args) | {
            "dtype": dtype,
            "max_model_len": max_len,
            "quantization": resolve_quantization(
                quantization, hf_config, self.model, self.load_format, device
            ),
        }

        sched_args = _fields_of(SchedulerConfig, args) | {"max_model_len": max_len}
        if self.max_num_seqs is None or self.max_num_batched_tokens is None:
            seqs, tokens = default_batch_limits(_gpu_memory_and_name(device), usage_context)
            sched_args["max_num_seqs"] = self.max_num_seqs or seqs
            sched_args["max_num_batched_tokens"] = self.max_num_batched_tokens or tokens
        if self.max_prefill_tokens_with_decodes is None:
            sched_args["max_prefill_tokens_with_decodes"] = (
                SERVER_PREFILL_TOKENS_WITH_DECODES if usage_context == "server" else 0
            )
        check_swap_space(self.swap_space, self.world_size)
        check_weight_cache(self.weight_cache_gb, self.swap_space, self.world_size)
        runner_args: dict[str, Any] = {"enforce_eager": self.enforce_eager}
        if self.prefill_cuda_graph_tokens is not None:
            runner_args["prefill_cuda_graph_tokens"] = self.prefill_cuda_graph_tokens
        elif self.tensor_parallel_size > 1:
            # Piecewise graphs across tensor-parallel ranks have not yet run on GPUs: only
            # when asked for.
            runner_args["prefill_cuda_graph_tokens"] = 0
        return EngineConfig(
            model_config=ModelConfig(**model_args),
            cache_config=CacheConfig(**_fields_of(CacheConfig, args)),
            scheduler_config=SchedulerConfig(**sched_args),
            parallel_config=ParallelConfig(**_fields_of(ParallelConfig, args)),
            device=device,
            **runner_args,
        )

    def _resolved_max_model_len(self, hf_config: Any) -> int:
        max_len = self.max_model_len
        model_max = _model_max_len(hf_config)
        if max_len is None:
            max_len = model_max
        elif model_max is not None and max_len > model_max:
            raise ValueError(
                f"max_model_len={max_len} exceeds the model's max_position_embeddings={model_max}"
            )
        return max_len or 2048


SWAP_SPACE_HOST_FRACTION = 0.7
"""The most of the host's memory swap_space may pin, all ranks together: pinned pages cannot
be paged out, and the engine's own processes need the rest."""


def host_memory_bytes() -> int:
    """The host's physical memory (os.sysconf; /proc/meminfo's MemTotal where sysconf lacks it)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    raise ValueError("cannot read the host's memory size")


def check_swap_space(swap_space: float, num_ranks: int, total: int | None = None) -> None:
    """ValueError naming swap_space when num_ranks x swap_space GiB is more than
    SWAP_SPACE_HOST_FRACTION of the host's memory (`total` bytes, read when None). The ranks
    are counted as if all ran on this host: the stricter reading for a group on one node."""
    if swap_space < 0:
        raise ValueError(f"swap_space must be >= 0 GiB, got {swap_space}")
    if swap_space == 0:
        return
    total = host_memory_bytes() if total is None else total
    wanted = swap_space * num_ranks * 2**30
    if wanted > SWAP_SPACE_HOST_FRACTION * total:
        raise ValueError(
            f"swap_space={swap_space} GiB x {num_ranks} rank(s) = {wanted / 2**30:.1f} GiB of "
            f"pinned memory is more than {SWAP_SPACE_HOST_FRACTION:.0%} of this host's "
            f"{total / 2**30:.1f} GiB: lower swap_space"
        )


def check_weight_cache(
    weight_cache_gb: float, swap_space: float, num_ranks: int, total: int | None = None
) -> None:
    """ValueError naming weight_cache_gb when it and swap_space together, x num_ranks, would
    pin more than SWAP_SPACE_HOST_FRACTION of the host's memory (`total` bytes, read when
    None)."""
    if weight_cache_gb == 0:
        return
    total = host_memory_bytes() if total is None else total
    wanted = (weight_cache_gb + swap_space) * num_ranks * 2**30
    if wanted > SWAP_SPACE_HOST_FRACTION * total:
        raise ValueError(
            f"weight_cache_gb={weight_cache_gb} GiB (+ swap_space={swap_space} GiB) x "
            f"{num_ranks} rank(s) = {wanted / 2**30:.1f} GiB of pinned memory is more than "
            f"{SWAP_SPACE_HOST_FRACTION:.0%} of this host's {total / 2**30:.1f} GiB: lower "
            "weight_cache_gb"
        )


def _fields_of(part: type[BaseModel], args: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in args.items() if k in part.model_fields}
