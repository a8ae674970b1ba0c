"""Peak memory per GPU and per node of an FSDP2 (ZeRO-3) full fine-tune, and checkpoint size, from a model config.

Each estimate is a sum of named terms (printed in gate.md) so an operator can
see which one does not fit. Three phases peak differently on the device:

- load: the model is built on the meta device, sharded, and only the local
  fp32 shards are materialized; each parameter's local rows are then read
  (one positioned read per tensor, in the file's dtype) or random-initialized, one
  parameter at a time.
- steady state (`estimate_memory`): byte counts per parameter follow FSDP2
  with a bf16 MixedPrecisionPolicy: sharded parameters, gradients and AdamW
  moments stay in fp32 (4 + 4 + 8 bytes, divided by the shard degree: the
  world size, or with HSDP (parallel.replicate) the world over the replicas); each
  layer is all-gathered in bf16 for compute, the current and the prefetched
  one at a time, and its gradient is reduce-scattered in fp32. With expert
  parallelism (parallel.expert E > 1) a rank holds E-th of each MoE layer's
  experts, sharded over the shard degree / E ranks holding the same ones: the
  same sharded bytes, but it gathers only its own experts, and each MoE layer
  exchanges its routed tokens by all-to-all. With context parallelism (parallel.context C > 1)
  a rank holds 1/C of each packed row's tokens, so its per-token terms fall by C, but every
  attention layer gathers the whole row's keys and values and masks [rows, seq_len / C, seq_len]
  (query, key) pairs (train/context_parallel.py): `context_attention_bytes`.
- export: gradients are freed; per parameter every rank casts its shard to
  the export dtype and all-gathers the full parameter, which the rank writing
  the current file streams into it.

The host (per node) holds every rank's process, the load/export staging
copies, and the page cache of the checkpoint files its ranks read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from wattgate.errors import InputError
from wattgate.gpus import is_cpu, memory_gib, memory_names
from wattgate.model_spec import (
    DEFAULT_CONFIG_DTYPE,
    DTYPE_BYTES,
    ModelSpec,
    config_dtype_name,
    largest_local_slice,
    largest_param,
    read_model_folder_config,
)
from wattgate.records.run_config import RunConfig

GIB = 1 << 30
MIB = 1 << 20

# What no formula below covers: on a GPU the CUDA context, NCCL buffers and
# allocator slack; on a CPU rank the interpreter, torch, transformers and gloo (0.36 GiB
# when loading starts) and the heap the step leaves: 0.50-0.55 GiB beyond the other
# steady terms with launch's glibc setting (train/launch.py CPU_ALLOCATOR_ENV), measured
# on Qwen3 shapes of 12 and 24 layers by bench/steady_memory.py.
RUNTIME_OVERHEAD_BYTES = {"gpu": 3 * GIB, "cpu": GIB // 2}

# Host RSS of one rank's process before any model tensor. GPU: an assumption, not
# measured here: python + torch + the CUDA runtime and its libraries (cuBLAS, cuDNN),
# NCCL and transformers typically hold 2-5 GB resident; we take 4 GiB. CPU: the
# measured ~0.75 GB above (the same process; its device memory is host memory).
HOST_RUNTIME_BYTES = {"gpu": 4 * GIB, "cpu": RUNTIME_OVERHEAD_BYTES["cpu"]}

# One torchrun agent per node (measured ~225 MB on the two-node local Slurm test).
TORCHRUN_AGENT_BYTES = 256 * MIB

# Random init fills a parameter's local rows in blocks of this many elements.
INIT_BLOCK_ELEMENTS = 1 << 20


# Bytes per element of the dtypes a checkpoint or an export may hold.
@dataclass(frozen=True)
class CheckpointSource:
    """The safetensors checkpoint the loader reads its slices from."""

    dtype: str  # of the tensors in the files
    file_bytes: int | None  # sum of *.safetensors sizes; None: not there (yet), num_params x dtype bytes is assumed


def safetensors_bytes(folder: Path) -> int | None:
    """Total size of the *.safetensors files in `folder`, or None when there are none."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        try:
            total += f.stat().st_size
        except OSError as exc:
            raise InputError(f"{f}: cannot read its size ({exc.strerror})") from None
    return total


def checkpoint_source(config: RunConfig) -> CheckpointSource | None:
    """What the loader reads for model.path: file dtype (config.json) and bytes; None for random init."""
    model = config.model
    if not model.path:
        return None
    cfg, path = read_model_folder_config(model.path)
    dtype = config_dtype_name(cfg, str(path)) or DEFAULT_CONFIG_DTYPE
    return CheckpointSource(dtype=dtype, file_bytes=safetensors_bytes(path.parent))


@dataclass(frozen=True)
class FitSettings:
    world_size: int
    tokens_per_micro_batch: int
    activation_checkpointing: bool
    mixed_precision: bool  # bf16 compute with fp32 master weights; False: fp32 throughout
    on_gpu: bool = True
    nodes: int = 1
    source: CheckpointSource | None = None  # None: random init (model.config)
    export_dtype: str = "bfloat16"
    loss: str = "chunked"  # train.loss
    loss_chunk_tokens: int = 1024  # train.loss_chunk_tokens
    eval_tokens_per_micro_batch: int = 0  # the validation forward's micro-batch; 0: no validation
    optimizer: str = "adamw"  # train.optimizer: adamw keeps two fp32 moments, sgd (no momentum) none
    replicate: int = 1  # parallel.replicate: HSDP keeps this many replicas of the sharded state
    expert: int = 1  # parallel.expert: each MoE layer's experts split between this many ranks
    context: int = 1  # parallel.context: ranks sharing each packed row, each holding 1/C of its tokens
    seq_len: int = 0  # train.seq_len, a row's tokens: what the context terms gather; 0: not given (C must be 1)
    context_kernel: str = "sdpa"  # context_layout.planned_context_kernel: flex keeps no pair mask and no repeated kv

    def __post_init__(self) -> None:
        if self.context > 1 and not self.seq_len:
            raise ValueError("FitSettings: context > 1 needs seq_len (the row the context terms gather)")

    @property
    def rank_tokens(self) -> int:
        """A training micro-batch's tokens on one rank: its rows' 1/C under context parallelism."""
        return self.tokens_per_micro_batch // self.context

    @property
    def rank_eval_tokens(self) -> int:
        """The validation micro-batch's tokens on one rank (0: no validation)."""
        return self.eval_tokens_per_micro_batch // self.context

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nodes

    @property
    def shard_degree(self) -> int:
        """The ranks each parameter, gradient and optimizer state is sharded over: the world, over the replicas."""
        return self.world_size // self.replicate

    @property
    def expert_shard_degree(self) -> int:
        """The ranks holding the same experts, over which FSDP2 shards them (train/mesh.py ep_shard)."""
        return self.shard_degree // self.expert

    @property
    def nodes_per_shard_group(self) -> int:
        """The nodes one shard group spans (its ranks read the whole checkpoint between them); 1 when a node holds
        one or more whole shard groups."""
        return max(1, self.shard_degree // self.ranks_per_node)

    @property
    def runtime_kind(self) -> str:
        return "gpu" if self.on_gpu else "cpu"


def validation_tokens_per_micro_batch(config: RunConfig) -> int:
    """Tokens of one validation micro-batch per rank (train.eval_micro_batch_size, else micro_batch_size, x
    seq_len); 0 when data.validation names no held-out split."""
    v, t = config.data.validation, config.train
    if not (v.inputs or v.fraction or v.max_docs):
        return 0
    return (t.eval_micro_batch_size or t.micro_batch_size) * t.seq_len


def chunked_loss_bytes(spec: ModelSpec, s: FitSettings, tokens: int, with_grad: bool) -> int:
    """Peak bytes of torch's chunked linear cross-entropy (train/loss.py) over `tokens` rows.

    Read from torch 2.13's implementation (torch/nn/modules/linear_cross_entropy.py): one chunk's
    logits in fp32 (its accumulation dtype), on CUDA with bf16 inputs also their bf16 copy for the
    gradient matmuls; with a graph (reduction sum) the hidden state's [tokens, H] and the head's [V, H]
    gradients, computed in the forward and held until backward, in the compute dtype. Without a graph
    (validation, reduction none) the per-token losses.
    """
    compute = 2 if s.mixed_precision else 4
    chunk = min(s.loss_chunk_tokens, tokens)
    per_logit = 4 + (2 if s.mixed_precision and s.on_gpu else 0)
    if not with_grad:
        return chunk * spec.vocab_size * 4 + tokens * compute
    return chunk * spec.vocab_size * per_logit + (tokens + spec.vocab_size) * spec.hidden_size * compute


def logits_bytes(spec: ModelSpec, s: FitSettings, tokens: int, with_grad: bool = True) -> int:
    """The loss's logits: one chunk's (train.loss chunked) or the micro-batch's (full)."""
    if s.loss == "chunked":
        return chunked_loss_bytes(spec, s, tokens, with_grad)
    compute = 2 if s.mixed_precision else 4
    # logits in compute dtype, their fp32 upcast for the loss, and its gradient (no gradient without a graph)
    return tokens * spec.vocab_size * (compute + (8 if with_grad else 4))


def activation_bytes(spec: ModelSpec, s: FitSettings) -> int:
    """What autograd keeps through a training micro-batch's forward."""
    compute = 2 if s.mixed_precision else 4
    per_layer_act = spec.activation_elements_per_token_layer() * compute
    tokens = s.rank_tokens
    if s.activation_checkpointing:
        return tokens * spec.num_layers * spec.hidden_size * compute + tokens * per_layer_act
    return tokens * spec.num_layers * per_layer_act


def validation_forward_bytes(spec: ModelSpec, s: FitSettings) -> dict[str, int]:
    """The validation forward (no graph): one layer's activations at a time and the loss's logits."""
    tokens = s.rank_eval_tokens
    compute = 2 if s.mixed_precision else 4
    return {
        "activations": tokens * spec.activation_elements_per_token_layer() * compute,
        "logits": logits_bytes(spec, s, tokens, with_grad=False),
    }


def optimizer_state(spec: ModelSpec, s: FitSettings) -> dict[str, int]:
    """AdamW's two fp32 moments per parameter, sharded; SGD without momentum keeps nothing."""
    return {"sharded_adam_state_fp32": spec.num_params * 8 // s.shard_degree} if s.optimizer == "adamw" else {}


def gathered_layer_params(spec: ModelSpec, s: FitSettings) -> int:
    """The parameters of the largest decoder layer a rank gathers: all of them, or under EP only its own E-th of an
    MoE layer's experts (their FSDP2 unit spans the ranks holding the same experts; another rank's are never
    gathered). The largest layer is taken to be an MoE one: many experts outweigh a dense MLP."""
    if s.expert == 1:
        return spec.layer_params
    return spec.layer_params - spec.expert_params * (s.expert - 1) // s.expert


def expert_all_to_all_bytes(spec: ModelSpec, s: FitSettings) -> dict[str, int]:
    """Under EP, one MoE layer's token exchange in flight (train/expert_parallel.py): the rows sent, one per token
    and routed expert, and as many received, in the compute dtype, for the larger of the training and validation
    micro-batches. Received rows are taken to match the sent ones (a balanced router); what autograd keeps of
    them is in `activations` already. Nothing without EP."""
    if s.expert == 1:
        return {}
    compute = 2 if s.mixed_precision else 4
    tokens = max(s.tokens_per_micro_batch, s.eval_tokens_per_micro_batch)
    rows = tokens * max(1, spec.experts_per_token)
    return {"expert_all_to_all": 2 * rows * spec.hidden_size * compute}


# torch's scaled_dot_product_attention with a boolean mask keeps about this many bytes per (query, key) pair from a
# layer's forward to its backward (measured on CPU: one layer at 16k x 16k, +1.0 GiB kept; bench/context_memory.py,
# docs/benchmarks.md). On CUDA the memory-efficient kernel's additive mask in bf16 would be 2: 4 is the upper bound.
SDPA_MASK_BYTES_PER_PAIR = 4


def context_attention_bytes(spec: ModelSpec, s: FitSettings, tokens: int, with_grad: bool) -> dict[str, int]:
    """What context parallelism's attention adds on a rank for a micro-batch of `tokens` row tokens (before the
    split), beyond the per-token activations; nothing at C = 1 (no gather, no mask of our own).

    Per gathered row token: the all-gather's keys and values (2 x kv heads x head_dim) and, under GQA, their copies
    repeated to every query head (2 x q heads x head_dim), in context_attention. Assumed at the peak of one
    layer's backward: its forward copies and as many again for their gradients before the reduce-scatter (so with
    a graph, twice). Without activation checkpointing sdpa keeps every other layer's repeated keys and values
    (the gather buffer itself is freed once repeated or, without GQA, is what is kept) until the backward; with it
    only the layer being recomputed holds them, counted in the first term. The boolean mask is built once per
    micro-batch (1 byte per pair; one per sliding window: a family mixing sliding and full layers would build
    two, not counted). sdpa's float copy of the mask
    is kept per layer without checkpointing, one layer's with it (or without a graph: in flight). Under the flex
    kernel (FitSettings.context_kernel) only the gathered keys and values: it repeats no heads, and its block mask
    holds a few bytes per 128 x 128 block."""
    if s.context == 1 or not tokens:
        return {}
    compute = 2 if s.mixed_precision else 4
    if s.context_kernel == "flex":  # GQA inside the kernel and a block mask: only the gathered keys and values
        return {"context_gathered_kv": tokens * 2 * spec.kv_dim * compute * (2 if with_grad else 1)}
    pairs = (tokens // s.context) * s.seq_len  # the rank's queries x their row's keys
    repeated = 2 * spec.q_dim if spec.num_heads != spec.num_kv_heads else 0
    in_flight = tokens * (2 * spec.kv_dim + repeated) * compute
    keeps_layers = with_grad and not s.activation_checkpointing
    return {
        "context_gathered_kv": in_flight * (2 if with_grad else 1),
        **({"context_kept_kv": tokens * 2 * spec.q_dim * compute * (spec.num_layers - 1)} if keeps_layers else {}),
        "context_mask": pairs,
        "context_sdpa_mask_copy": pairs * SDPA_MASK_BYTES_PER_PAIR * (spec.num_layers if keeps_layers else 1),
    }


def context_terms(spec: ModelSpec, s: FitSettings) -> dict[str, int]:
    """Each context term, the larger of the training step's and the validation forward's."""
    train = context_attention_bytes(spec, s, s.tokens_per_micro_batch, with_grad=True)
    validation = context_attention_bytes(spec, s, s.eval_tokens_per_micro_batch, with_grad=False)
    return {name: max(value, validation.get(name, 0)) for name, value in train.items()}


def estimate_memory(spec: ModelSpec, s: FitSettings) -> dict[str, int]:
    """Steady-state (training step or validation forward) peak bytes per GPU, term by term.

    `activations` and `logits` are each the larger of the training step's and the validation
    forward's (train.eval_micro_batch_size may be larger than training's); the other terms are
    the same in both.
    """
    compute = 2 if s.mixed_precision else 4
    validation = validation_forward_bytes(spec, s) if s.eval_tokens_per_micro_batch else {}
    layer = gathered_layer_params(spec, s)
    # under EP too: E-th of the experts over shard degree / E ranks is every expert over the shard degree
    return {
        "sharded_params_fp32": spec.num_params * 4 // s.shard_degree,
        "sharded_grads_fp32": spec.num_params * 4 // s.shard_degree,
        **optimizer_state(spec, s),
        # two layers gathered (current + prefetched) and the root's embedding/head, in compute dtype
        "gathered_params": (2 * layer + spec.embedding_params) * compute,
        "unsharded_grads_fp32": (layer + spec.embedding_params) * 4,
        "activations": max(activation_bytes(spec, s), validation.get("activations", 0)),
        "logits": max(logits_bytes(spec, s, s.rank_tokens), validation.get("logits", 0)),
        **expert_all_to_all_bytes(spec, s),
        **context_terms(spec, s),
        "runtime_overhead": RUNTIME_OVERHEAD_BYTES[s.runtime_kind],
    }


def logits_note(spec: ModelSpec, s: FitSettings) -> str:
    """gate.md's line naming what the steady `logits` term is."""
    if s.loss != "chunked":
        return (
            f"logits: train.loss full, the whole [{s.rank_tokens:,} tokens x {spec.vocab_size:,}] "
            "logits, their fp32 upcast and gradient"
        )
    chunk = min(s.loss_chunk_tokens, s.rank_tokens)
    return (
        f"logits: train.loss chunked, one chunk of {chunk:,} tokens x {spec.vocab_size:,} vocab in fp32, "
        f"plus the hidden-state and head gradients the loss computes in its forward (never the whole "
        f"{s.rank_tokens:,}-token micro-batch's logits)"
    )


def load_staging_bytes(spec: ModelSpec, s: FitSettings) -> dict[str, int]:
    """The one parameter slice in flight while loading: in the file's dtype and its fp32 cast.

    Random init instead generates fp32 blocks of INIT_BLOCK_ELEMENTS.
    """
    _, local = largest_local_slice(spec, s.shard_degree)
    if s.source is None:
        return {"init_block_fp32": min(local, INIT_BLOCK_ELEMENTS) * 4}
    return {
        "largest_param_slice_file_dtype": local * DTYPE_BYTES[s.source.dtype],
        "largest_param_slice_fp32": local * 4,
    }


def estimate_load_memory(spec: ModelSpec, s: FitSettings) -> dict[str, int]:
    """Peak bytes per rank on the device while loading: the fp32 shards plus one slice in flight.

    The slice is cast on the host or the device (the trainer's choice): counting
    both copies on the device keeps this an upper bound; either is small.
    """
    return {
        "sharded_params_fp32": spec.num_params * 4 // s.shard_degree,
        **load_staging_bytes(spec, s),
        "runtime_overhead": RUNTIME_OVERHEAD_BYTES[s.runtime_kind],
    }


def estimate_export_memory(spec: ModelSpec, s: FitSettings) -> dict[str, int]:
    """Peak bytes per rank on the device while writing final/: one full parameter gathered at a time."""
    dtype_bytes = DTYPE_BYTES[s.export_dtype]
    _, shape = largest_param(spec)
    return {
        # still allocated: the model's shards and AdamW's moments (gradients were set to None)
        "sharded_params_fp32": spec.num_params * 4 // s.shard_degree,
        **optimizer_state(spec, s),
        "gathered_param_export_dtype": math.prod(shape) * dtype_bytes,
        "local_cast_export_dtype": largest_local_slice(spec, s.shard_degree)[1] * dtype_bytes,
        "runtime_overhead": RUNTIME_OVERHEAD_BYTES[s.runtime_kind],
    }


def checkpoint_file_bytes(spec: ModelSpec, source: CheckpointSource | None) -> int:
    """Bytes of the checkpoint files the loader maps (0 for random init)."""
    if source is None:
        return 0
    if source.file_bytes is not None:
        return source.file_bytes
    return spec.num_params * DTYPE_BYTES[source.dtype]


def estimate_host_memory_per_node(spec: ModelSpec, s: FitSettings) -> dict[str, int]:
    """Peak host RAM of one node, term by term: an upper bound, each term at its own worst phase.

    Per rank the host holds its process, the load slice (file dtype + fp32 cast)
    or, while exporting, the full parameter its file writer streams; on CPU ranks
    also every device tensor. The checkpoint pages the node's ranks read (positioned
    reads, train/safetensors_io.py) stay in the page cache after loading: counted,
    since a Slurm job's cgroup is charged for it.
    """
    ranks = s.ranks_per_node
    load_host = sum(load_staging_bytes(spec, s).values())
    export_host = math.prod(largest_param(spec)[1]) * DTYPE_BYTES[s.export_dtype]
    terms = {
        "process_runtime": ranks * HOST_RUNTIME_BYTES[s.runtime_kind],
        "param_staging": ranks * max(load_host, export_host),
        # each shard group reads the whole checkpoint between its ranks: a node its share of its group's reads
        "loader_page_cache": -(-checkpoint_file_bytes(spec, s.source) // s.nodes_per_shard_group),
        "torchrun_agent": TORCHRUN_AGENT_BYTES,
    }
    if not s.on_gpu:  # the device is the host: each rank's largest device peak, less the runtime counted above
        device_peak = max(
            sum(estimate_load_memory(spec, s).values()),
            sum(estimate_memory(spec, s).values()),
            sum(estimate_export_memory(spec, s).values()),
        )
        terms["device_tensors_on_host"] = ranks * (device_peak - RUNTIME_OVERHEAD_BYTES["cpu"])
    return terms


def estimate_phases(spec: ModelSpec, s: FitSettings, steady: dict[str, int] | None = None) -> dict[str, dict[str, int]]:
    """Every phase's terms: device per rank for load, steady, export; host RAM per node."""
    return {
        "load": estimate_load_memory(spec, s),
        "steady": steady if steady is not None else estimate_memory(spec, s),
        "export": estimate_export_memory(spec, s),
        "host_per_node": estimate_host_memory_per_node(spec, s),
    }


def checkpoint_bytes(spec: ModelSpec) -> int:
    """One DCP checkpoint: fp32 parameters plus the two AdamW moments."""
    return spec.num_params * 12


@dataclass(frozen=True)
class Budget:
    """Memory a phase may use, and where that number came from; bytes None means unknown (not checked)."""

    bytes: int | None
    source: str
    per: str  # "rank" (device) or "node" (host)


def device_memory_bytes(config: RunConfig) -> tuple[int, str]:
    """Memory one rank may use, and where that number came from."""
    cluster = config.cluster
    if cluster.gpu_mem_gib:
        return int(cluster.gpu_mem_gib * GIB), "cluster.gpu_mem_gib"
    model = cluster.gpu_model
    if is_cpu(model):
        import os

        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return host // cluster.gpus_per_node, f"host memory / {cluster.gpus_per_node} processes"
    known = memory_gib(model)
    if known is None:
        raise InputError(
            f"config: cluster.gpu_model '{model}' is not in the memory table ({', '.join(memory_names())}); "
            "set cluster.gpu_mem_gib"
        )
    gib, entry = known
    return gib * GIB, f"{entry} table entry"


def meminfo_total_bytes(meminfo: Path) -> int:
    """MemTotal of a /proc/meminfo-format file, in bytes."""
    try:
        text = meminfo.read_text()
    except OSError as exc:
        raise InputError(f"{meminfo}: cannot read ({exc.strerror}); set cluster.host_mem_gib") from None
    for line in text.splitlines():
        fields = line.split()
        if fields[:1] == ["MemTotal:"] and len(fields) >= 2 and fields[1].isdigit():
            return int(fields[1]) * 1024  # the kernel writes kB meaning KiB
    raise InputError(f"{meminfo}: no MemTotal line; set cluster.host_mem_gib")


NOT_CHECKED = "not checked: set cluster.host_mem_gib"


def host_memory_budget(config: RunConfig, meminfo: Path = Path("/proc/meminfo")) -> Budget:
    """Host RAM per node the train job may use: cluster.host_mem_gib, the Slurm --mem, local RAM on cpu runs."""
    cluster = config.cluster
    if cluster.host_mem_gib:
        return Budget(int(cluster.host_mem_gib * GIB), "cluster.host_mem_gib", "node")
    mem_mb = cluster.slurm.train.mem_mb
    if mem_mb:
        return Budget(mem_mb * MIB, "cluster.slurm.train.mem_mb", "node")  # Slurm's MB are MiB
    if is_cpu(cluster.gpu_model):
        return Budget(meminfo_total_bytes(meminfo), f"{meminfo} MemTotal", "node")
    return Budget(None, NOT_CHECKED, "node")


@dataclass(frozen=True)
class FitEstimate:
    phases: dict[str, dict[str, int]]  # load, steady, export, host_per_node -> term -> bytes
    budgets: dict[str, Budget]  # the same keys
    notes: dict[str, str]  # phase -> what a person needs to read its terms (e.g. which parameter is largest)
    mesh: str = ""  # what the fit check's detail says of the mesh; empty for the plain FSDP2 one
    # steady peak per rank at each parallel.context the run could grow to (context_steady_totals); empty: none
    context_steady: dict[int, int] = field(default_factory=dict)


def expert_mesh_note(spec: ModelSpec, s: FitSettings) -> str:
    """Under EP, the experts a rank holds and gathers (the fit check's detail names the degree); empty without."""
    if s.expert == 1:
        return ""
    return (
        f"parallel.expert {s.expert}: a rank holds and gathers {spec.num_experts // s.expert} of each MoE layer's "
        f"{spec.num_experts} experts, sharded over {s.expert_shard_degree} rank(s)"
    )


def context_mesh_note(s: FitSettings) -> str:
    """Under CP, the share of each row a rank holds (the fit check's detail names the degree); empty without."""
    if s.context == 1:
        return ""
    return (
        f"parallel.context {s.context}: a rank holds {s.seq_len // s.context:,} of each {s.seq_len:,}-token row and "
        "gathers the row's keys and values in every attention layer"
    )


def mesh_note(spec: ModelSpec, s: FitSettings) -> str:
    return "; ".join(filter(None, (expert_mesh_note(spec, s), context_mesh_note(s))))


def context_candidates(s: FitSettings) -> list[int]:
    """The parallel.context degrees larger than the run's that config would accept: divisors of the shard group
    size with train.seq_len a multiple of 2C (config.context_line). None under parallel.expert > 1, which config
    refuses together with C > 1, or without a seq_len."""
    if s.expert > 1 or not s.seq_len:
        return []
    shard = s.shard_degree
    return [c for c in range(s.context + 1, shard + 1) if shard % c == 0 and s.seq_len % (2 * c) == 0]


def context_steady_totals(spec: ModelSpec, s: FitSettings) -> dict[int, int]:
    """The steady peak per rank at each candidate parallel.context: what the fit check's suggestion picks from."""
    return {c: sum(estimate_memory(spec, replace(s, context=c)).values()) for c in context_candidates(s)}


def phase_notes(spec: ModelSpec, s: FitSettings) -> dict[str, str]:
    """One line per phase naming what its staging terms are made of."""
    slice_name, slice_elements = largest_local_slice(spec, s.shard_degree)
    name, shape = largest_param(spec)
    if s.source is None:
        source = "random init"
    else:
        found = "" if s.source.file_bytes is not None else " (no `*.safetensors` found: num_params x dtype assumed)"
        source = f"{s.source.dtype} checkpoint of {checkpoint_file_bytes(spec, s.source) / GIB:.1f} GiB{found}"
    return {
        "load": f"largest local slice: {slice_name}, {slice_elements:,} elements per rank; {source}",
        "steady": "; ".join(filter(None, (logits_note(spec, s), mesh_note(spec, s)))),
        "export": f"largest parameter: {name} {list(shape)}, gathered in {s.export_dtype}",
        "host_per_node": f"{s.ranks_per_node} rank(s) per node; page cache: the checkpoint / "
        f"{s.nodes_per_shard_group} node(s)"
        + (f" of a shard group ({s.replicate} replicas)" if s.replicate > 1 else ""),
    }


def fit_estimate(
    spec: ModelSpec, s: FitSettings, device: Budget, host: Budget, steady: dict[str, int] | None = None
) -> FitEstimate:
    """Every phase's terms with the budget it is checked against (device per rank, host per node)."""
    return FitEstimate(
        phases=estimate_phases(spec, s, steady),
        budgets={"load": device, "steady": device, "export": device, "host_per_node": host},
        notes=phase_notes(spec, s),
        mesh=mesh_note(spec, s),
        context_steady=context_steady_totals(spec, s),
    )
