"""Everything train/ reads from the run config, typed and built once (`TrainSettings.from_config`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from wattgate.model_spec import export_dtype_name
from wattgate.train.loss import LossSettings
from wattgate.records.run_config import RunConfig

# TrainSettings fields that are not a train.* key of the same name (built in from_config)
_DERIVED = frozenset(
    {"betas", "mixed_precision", "export_dtype", "eval_micro_batch_size", "loss", "run_name", "gpu_model", "ledger"}
)


@dataclass(frozen=True)
class TrainSettings:
    """Everything train/ reads from the config, typed, built once (the train.* keys keep their names)."""

    seq_len: int
    micro_batch_size: int
    grad_accum: int
    epochs: int
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    seed: int
    checkpoint_every: int
    checkpoint_keep: int
    checkpoint_at_epoch_end: bool
    collective_timeout_s: float
    attn_implementation: str
    activation_checkpointing: bool
    data_cache: str
    local_cache_dir: str | None
    log_every: int
    optimizer: str
    max_steps: int | None
    export_max_shard_gib: float
    tensorboard: bool
    check_planned_counts: bool
    eval_every: int
    keep_best: bool
    export_from: str
    betas: tuple[float, float]
    mixed_precision: bool
    export_dtype: str
    eval_micro_batch_size: int
    loss: LossSettings
    run_name: str
    gpu_model: str
    ledger: Path
    on_nonfinite: str
    nonfinite_skip_limit: int
    compile: bool

    @classmethod
    def from_config(cls, config: RunConfig) -> TrainSettings:
        t = config.train
        given = t.to_json()  # the train section's keys TrainSettings shares by name
        names = [f.name for f in dataclasses.fields(cls) if f.name not in _DERIVED]
        beta1, beta2 = t.betas  # two (the config schema's minItems and maxItems)
        return cls(
            **{k: given[k] for k in names if k in given},
            betas=(beta1, beta2),
            mixed_precision=t.mixed_precision == "bf16",
            export_dtype=export_dtype_name(config),
            eval_micro_batch_size=t.eval_micro_batch_size or t.micro_batch_size,
            loss=LossSettings.from_train(t),
            run_name=config.run_name,
            gpu_model=config.cluster.gpu_model,
            ledger=Path(config.forecast.ledger),
        )
