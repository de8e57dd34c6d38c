"""params.yaml -> typed, validated dataclasses. One source of configuration for every stage.

Each section is a settings dataclass (model/settings.py: types, allowed values as `Literal[...]`,
`MINIMUM`, and `check()` for what relates several fields), whose defaults are params.yaml's values (a test
keeps them equal) and whose docstrings document each knob. `load_params()` reads params.yaml, overlays
`profiles/<profile>.yaml` when `profile` is set, and checks every key before any work starts: an
unknown key, a wrong type or an impossible value raises `ConfigError` naming the key (e.g.
`pretrain.matrix_lr`). One dial, `model.depth`, sets the model's width and heads (and through them the
learning-rate scaling and the pretraining token budget).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import yaml

from model.precision.options import (BACKEND_NAMES, BACKEND_OPTIONS, AutoOptions, BackendName, Fp8Options, LayerFilter,
                                     Nvfp4Options, Options, ProbeOptions, TEFp8Options)
from model.settings import SettingError, Settings
from sparkchat import paths

ROOT = Path(__file__).resolve().parent.parent
ConfigError = SettingError  # what every stage catches: a bad setting, named by its key
StageBackend = Literal[("",) + BACKEND_NAMES]  # a stage's backend; "" = precision.backend


@dataclass
class ModelParams(Settings):
    """The model's shape (pretrain builds it; later stages read it from the model directory)."""
    KEY: ClassVar[str] = "model"
    MINIMUM: ClassVar[dict[str, float]] = {"depth": 1, "aspect_ratio": 1, "head_dim": 2, "kv_head_ratio": 1,
                                           "seq_len": 1}
    depth: int = 4
    """The one dial: number of transformer blocks. Width = depth * aspect_ratio."""
    aspect_ratio: int = 32
    """Width per layer of depth: 32 keeps the default model narrow for a 2-core CPU (nanochat and the GPU
    profiles use 64)."""
    head_dim: int = 32
    """Channels per attention head (128 on GPU)."""
    kv_head_ratio: int = 2
    """Query heads per key/value head (grouped-query attention); 1 = plain multi-head."""
    seq_len: int = 128
    """Training context length in tokens."""

    @property
    def n_embd(self) -> int:
        return self.depth * self.aspect_ratio

    @property
    def n_head(self) -> int:
        return self.n_embd // self.head_dim

    @property
    def n_kv_head(self) -> int:
        return self.n_head // self.kv_head_ratio

    def gpt_config(self, vocab_size: int) -> dict:
        """The GPT this shape builds, for a tokenizer of `vocab_size` ids: `model.gpt.GPTConfig`'s fields
        (`GPTConfig(**...)`; a dict, so that reading params imports neither torch nor the model's code,
        and no stage that only reads params depends on model/gpt.py)."""
        return {"vocab_size": vocab_size, "n_layer": self.depth, "n_embd": self.n_embd, "n_head": self.n_head,
                "n_kv_head": self.n_kv_head, "seq_len": self.seq_len}

    def check(self, key: str) -> None:
        super().check(key)
        if self.n_embd % self.head_dim:
            raise ConfigError(f"{key}.head_dim={self.head_dim} does not divide the width "
                              f"depth*aspect_ratio={self.n_embd}")
        if self.n_head % self.kv_head_ratio:
            raise ConfigError(f"{key}.kv_head_ratio={self.kv_head_ratio} does not divide the "
                              f"{self.n_head} attention heads")
        if self.head_dim % 2:
            raise ConfigError(f"{key}.head_dim must be even (RoPE)")


@dataclass
class DataParams(Settings):
    """What the prepare stage reads: the pretraining text, the conversations and the generated tasks."""
    KEY: ClassVar[str] = "data"
    MINIMUM: ClassVar[dict[str, float]] = {"max_docs_per_source": 0, "pretrain_tokens": 0, "synthetic_train": 0,
                                           "synthetic_eval": 0, "tool_use_share": 0}
    pretrain_sources: list[str] = field(default_factory=lambda: ["builtin:shakespeare"])
    """Text sources: 'builtin:shakespeare', a local .txt/.jsonl/.parquet path, or 'hub:<id>[:<config>]'."""
    chat_sources: list[str] = field(default_factory=lambda: ["builtin:synthetic", "builtin:chatterbot"])
    """Conversation sources ('messages' in OpenAI format): builtin:synthetic, builtin:chatterbot,
    a local .jsonl/.parquet path, or 'hub:<id>[:<config>]' (e.g. hub:HuggingFaceTB/smol-smoltalk)."""
    text_field: str = "text"
    """Column holding the text in local/hub text sources."""
    hub_split: str = "train"
    """Split of a hub dataset to read."""
    max_docs_per_source: int = 0
    """Cap on documents/conversations read from each source (0 = all; hub chat sources need a cap)."""
    pretrain_tokens: int = 0
    """Pretraining text prepare reads, in tokens (train + val): the sources are read in order until it
    is in. 0 = derive: what pretrain consumes (its steps, or param_data_ratio x the model's matmul
    params), at least the tokenizer's train_chars and enough validation text for pretrain.eval_tokens,
    x 1.2, at an assumed 4 characters a token (pipeline/prepare.py, pretrain_token_budget)."""
    val_fraction: float = 0.05
    """Share held out for validation: of the pretraining text's chunks (each by a hash of its text) and of the
    shuffled conversations."""
    synthetic_train: int = 12000
    """Generated training exchanges (arithmetic, spelling, facts, identity, multiple choice)."""
    synthetic_multi_turn: float = 0.5
    """Share of the generated exchanges asked once more inside conversations of two or three exchanges
    (each is also a conversation of its own), so the model learns to answer the last question with
    earlier turns in its context, as the chat front ends send them. 0: single exchanges only."""
    tool_use_share: float = 0.5
    """Tool-use conversations (pipeline/tool_tasks.py), in number this share of `synthetic_train`, beside
    those exchanges. 1/6 left the default model calling the right function with the right arguments on
    0.41 of the held-out items (docs/evaluation.md, 'Tool use')."""
    synthetic_eval: int = 400
    """Held-out generated items per eval task (never in training data); a task with a small pool of prompts
    holds out at most half of it (spelling: 193)."""
    seed: int = 1337
    """Seed of the generated exchanges, of the conversations' shuffle and of the validation split."""

    def check(self, key: str) -> None:
        super().check(key)
        if not self.pretrain_sources:
            raise ConfigError(f"{key}.pretrain_sources must name at least one source")
        if not 0.0 < self.val_fraction < 0.5:
            raise ConfigError(f"{key}.val_fraction must be in (0, 0.5), got {self.val_fraction}")
        if not 0.0 <= self.synthetic_multi_turn <= 1.0:
            raise ConfigError(f"{key}.synthetic_multi_turn must be in [0, 1], got {self.synthetic_multi_turn}")
        for src in self.chat_sources:  # text sources stop at the token budget; conversations need a cap
            if src.startswith("hub:") and self.max_docs_per_source == 0:
                raise ConfigError(f"{key}.max_docs_per_source must be > 0 when streaming hub source '{src}'")


@dataclass
class TokenizerParams(Settings):
    """The byte-level BPE the tokenizer stage trains."""
    KEY: ClassVar[str] = "tokenizer"
    MINIMUM: ClassVar[dict[str, float]] = {"vocab_size": 300, "train_chars": 1}
    vocab_size: int = 2048
    """Tokens in the vocabulary: 256 bytes, the special tokens and the learned merges (at least 300)."""
    train_chars: int = 3_000_000
    """Characters of training text the BPE is trained on."""


@dataclass
class PrecisionParams(Settings):
    """The backend, and one block of options per backend: the backends' own dataclasses
    (model/precision/options.py declares their fields, defaults and allowed values, and checks them)."""
    KEY: ClassVar[str] = "precision"
    backend: BackendName = "bf16"
    """The backend of every training stage (a stage's own `backend` overrides it)."""
    fp8: Fp8Options = field(default_factory=Fp8Options)
    te_fp8: TEFp8Options = field(default_factory=TEFp8Options)
    nvfp4: Nvfp4Options = field(default_factory=Nvfp4Options)
    auto: AutoOptions = field(default_factory=AutoOptions)
    layer_filter: LayerFilter = field(default_factory=LayerFilter)

    def options_for(self, backend: str) -> Options | None:
        """The typed options backend `backend` runs with (None for one that takes none). auto without a
        probe file reads the probe stage's output."""
        cls = BACKEND_OPTIONS[backend]
        if cls is None:
            return None
        options = getattr(self, cls.KEY.rpartition(".")[2])
        if isinstance(options, AutoOptions) and not options.probe_file:
            options = dataclasses.replace(options, probe_file=str(paths.PROBE / "probe.json"))
        return options


@dataclass
class OptimizerParams(Settings):
    """What every training stage (pretrain, midtrain, sft, rl) sets of its precision and its optimizer
    (model/optim.py: Muon for the matrices, AdamW for the rest)."""
    MINIMUM: ClassVar[dict[str, float]] = {"weight_decay": 0, "grad_clip": 0}
    backend: StageBackend = ""
    """Precision backend for this stage; empty = precision.backend."""
    matrix_lr: float = 0.02
    """Learning rate of the matrices (Muon, or AdamW with use_muon false)."""
    embedding_lr: float = 0.2
    """AdamW learning rate of the token embeddings."""
    head_lr: float = 0.004
    """AdamW learning rate of the output head."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    use_muon: bool = True
    """Muon for the matrices; false: AdamW for everything."""
    grad_clip: float = 1.0
    """Largest gradient norm (0 = no clipping)."""

    def check(self, key: str) -> None:
        super().check(key)
        for name in ("matrix_lr", "embedding_lr", "head_lr"):
            if not 0.0 < getattr(self, name) < 10.0:
                raise ConfigError(f"{key}.{name} must be in (0, 10), got {getattr(self, name)}")


@dataclass
class TrainParams(OptimizerParams):
    """Settings of one training stage (pretrain, midtrain and sft each have their own block)."""
    MINIMUM: ClassVar[dict[str, float]] = {**OptimizerParams.MINIMUM, "total_batch_tokens": 1, "device_batch": 1,
                                           "steps": 0, "eval_every": 1, "eval_tokens": 1, "checkpoint_every": 1,
                                           "log_every": 1}
    total_batch_tokens: int = 8192
    """Tokens per optimizer step across all ranks (gradient accumulation fills the gap)."""
    device_batch: int = 32
    """Sequences per micro-step on one device."""
    steps: int = 0
    """Optimizer steps; 0 = derive (pretrain: param_data_ratio x params tokens; others: epochs)."""
    param_data_ratio: float = 1.0
    """Pretrain only: its token budget as tokens per matmul parameter when steps = 0. 1 keeps the CPU
    default to minutes; Chinchilla's ~20 is what the GPU profiles use."""
    epochs: float = 1.0
    """Midtrain/SFT passes over their data when steps = 0."""
    warmup_frac: float = 0.0
    """Share of the steps the learning rate ramps up over."""
    warmdown_frac: float = 0.4
    """Share of the steps at the end over which it falls linearly to final_lr_frac."""
    final_lr_frac: float = 0.0
    """The learning rate at the last step, as a share of the peak."""
    eval_every: int = 100
    """Steps between validation passes (and one at the end)."""
    eval_tokens: int = 32768
    """Validation tokens per pass, the same on any number of ranks."""
    checkpoint_every: int = 25
    """Steps between checkpoints (a killed stage resumes from the last one)."""
    log_every: int = 5
    """Steps between rows of the loss plot (each a host sync)."""
    seed: int = 42
    """Seed of the initial weights (pretrain), of torch's generator and of the conversations' order (SFT)."""

    def check(self, key: str) -> None:
        super().check(key)
        for name in ("param_data_ratio", "epochs"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{key}.{name} must be > 0, got {getattr(self, name)}")
        for name in ("warmup_frac", "warmdown_frac", "final_lr_frac"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{key}.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.warmup_frac + self.warmdown_frac > 1.0:
            raise ConfigError(f"{key}.warmup_frac + {key}.warmdown_frac must be <= 1")


def _default_mid() -> TrainParams:
    return TrainParams(warmdown_frac=0.5, matrix_lr=0.01, embedding_lr=0.1, head_lr=0.002)


def _default_sft() -> TrainParams:
    return TrainParams(total_batch_tokens=4096, warmdown_frac=1.0, matrix_lr=0.005, embedding_lr=0.05, head_lr=0.001,
                       eval_tokens=16384)


@dataclass
class BenchmarkParams(Settings):
    """One standard benchmark of the evaluate stage (pipeline/benchmarks.py reads and scores it)."""
    MINIMUM: ClassVar[dict[str, float]] = {"shots": 0}
    source: str = ""
    """'' skips the task; a local .jsonl/.json/.parquet file in the dataset's own schema (read with
    `datasets`); or 'hub:<id>[:<config>]' (downloaded by `datasets`, needs internet)."""
    shots: int = 0
    """Solved examples of the same task before each item: as text for base models (CORE-style), as
    earlier turns of the conversation for chat models."""

    def check(self, key: str) -> None:
        super().check(key)
        check_benchmark_source(self.source, f"{key}.source")


def _fixture(name: str):
    """A benchmark's default source: the few items of it committed under tests/fixtures/evals (the real
    dataset's schema), so the default run scores every benchmark offline; the GPU profiles name the hub."""
    return field(default_factory=lambda: BenchmarkParams(f"tests/fixtures/evals/{name}.jsonl"))


@dataclass
class BenchmarksParams(Settings):
    """The field's benchmarks, in their own schemas. Base models are scored by log-likelihood,
    chat models by generation (pipeline/evaluate.py says which is which)."""
    arc_easy: BenchmarkParams = _fixture("arc_easy")
    """ARC-Easy (hub:allenai/ai2_arc:ARC-Easy): grade-school science, 3-5 choices."""
    arc_challenge: BenchmarkParams = _fixture("arc_challenge")
    """ARC-Challenge (hub:allenai/ai2_arc:ARC-Challenge): the questions simple methods got wrong."""
    mmlu: BenchmarkParams = _fixture("mmlu")
    """MMLU (hub:cais/mmlu:all): 57 subjects, 4 choices, answered with a letter."""
    hellaswag: BenchmarkParams = _fixture("hellaswag")
    """HellaSwag (hub:Rowan/hellaswag): the most plausible of 4 endings of an everyday scene."""
    lambada: BenchmarkParams = _fixture("lambada")
    """LAMBADA (hub:EleutherAI/lambada_openai:default): the last word of a passage (language modelling;
    base models only)."""
    gsm8k: BenchmarkParams = _fixture("gsm8k")
    """GSM8K (hub:openai/gsm8k:main): grade-school word problems, the number after '####' (chat models
    only)."""


BENCHMARK_FILE_TYPES = (".jsonl", ".json", ".parquet")


@dataclass
class EvaluateParams(Settings):
    """What the evaluate stage scores each model on."""
    KEY: ClassVar[str] = "evaluate"
    MINIMUM: ClassVar[dict[str, float]] = {"max_items": 1, "max_new_tokens": 1}
    max_items: int = 100
    """Items per eval task: the held-out synthetic items, and of each benchmark a seeded sample."""
    max_new_tokens: int = 48
    """Tokens a chat model may generate per answer."""
    benchmarks: BenchmarksParams = field(default_factory=BenchmarksParams)
    """The field's benchmarks: each one's source and shots."""


RLTask = Literal["letter_count", "largest", "spelling", "arithmetic", "word_problem", "gsm8k"]


@dataclass
class RLParams(OptimizerParams):
    """The rl stage: on-policy reinforcement learning of the SFT model on verifiable tasks (docs/rl.md). Each
    step samples `samples` replies to each of `prompts_per_step` prompts through the engine, rewards each with
    the task's checker (pipeline/tasks.py, the evaluate stage's), and pushes up the log-probability of the
    replies that did better than their group's mean. The learning rates fall linearly to 0 over the steps."""
    KEY: ClassVar[str] = "rl"
    MINIMUM: ClassVar[dict[str, float]] = {**OptimizerParams.MINIMUM, "steps": 1, "prompts_per_step": 1, "samples": 2,
                                           "max_new_tokens": 1, "top_k": 0, "device_batch": 1, "eval_items": 1,
                                           "passk_items": 0, "eval_every": 0, "checkpoint_every": 1,
                                           "replay_weight": 0.0}
    # a tenth of pretraining's learning rates: the policy moves from SFT's weights, not from noise
    matrix_lr: float = 0.002
    embedding_lr: float = 0.02
    head_lr: float = 0.0004
    enabled: bool = True
    """false: the stage copies the SFT model unchanged to the chat model's place (export and the server then
    take SFT's model)."""
    tasks: list[RLTask] = field(default_factory=lambda: ["largest"])
    """Tasks trained on, equally often: the synthetic ones (prompts generated with `seed`, never one of the held-out
    items), and gsm8k (its `gsm8k_train` rows). By default largest of four, the one SFT leaves room on that RL can
    learn: not spelling (SFT almost never spells a word right, so its rewards are all 0), not letter counting
    beside it (its long replies take nearly all of a step's token-normalised weight; docs/rl.md)."""
    gsm8k_train: str = ""
    """GSM8K's training items in the hub's schema (question, answer '... #### N'): hub:openai/gsm8k:main (its train
    split) or a local .jsonl/.json/.parquet file; '' = none."""
    gsm8k_test: str = ""
    """GSM8K's held-out items for pass@1/pass@k (a hub source: its test split); '' = none."""
    steps: int = 200
    """Optimizer steps, each on a fresh batch of rollouts (on-policy)."""
    prompts_per_step: int = 16
    """Prompts per step over all ranks (split evenly over them: a multiple of the rank count)."""
    samples: int = 8
    """Replies sampled per prompt (the group whose mean reward is the baseline; k of pass@k)."""
    max_new_tokens: int = 48
    """Tokens a reply may take (calculator outputs included)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts and of pass@k."""
    top_k: int = 0
    """Sample from the k likeliest tokens; 0 = all."""
    device_batch: int = 64
    """Sequences per forward/backward micro-step on one device."""
    std_advantage: bool = False
    """Divide each advantage by its group's reward standard deviation (GRPO); false = reward - group mean only
    (docs/rl.md says why)."""
    replay_weight: float = 1.0
    """Weight of a supervised replay term (0: off): each step also takes `prompts_per_step` SFT conversations of
    the synthetic tasks not in `tasks` (their gold replies, never a held-out item) and adds this times their
    mean cross-entropy to the loss, so what RL does not train is held where SFT left it (docs/rl.md)."""
    eval_items: int = 400
    """Held-out items per task for pass@1 (the greedy reply, as the evaluate stage scores), before and after
    training."""
    passk_items: int = 50
    """Of those, the first ones pass@k is measured on (k = `samples` sampled replies each: k times the cost)."""
    eval_every: int = 0
    """Steps between extra held-out evaluations (0: before and after training only)."""
    checkpoint_every: int = 5
    """Steps between checkpoints (a killed stage resumes from the last one)."""
    seed: int = 42
    """Seed of the training prompts, of every rollout's sampling (per request) and of torch's generator."""

    def check(self, key: str) -> None:
        super().check(key)
        if not self.tasks or len(set(self.tasks)) != len(self.tasks):
            raise ConfigError(f"{key}.tasks must name at least one task, each once; got {self.tasks}")
        if "gsm8k" in self.tasks and not self.gsm8k_train:
            raise ConfigError(f"{key}.tasks has gsm8k but {key}.gsm8k_train is empty (e.g. hub:openai/gsm8k:main)")
        check_benchmark_source(self.gsm8k_train, f"{key}.gsm8k_train")
        check_benchmark_source(self.gsm8k_test, f"{key}.gsm8k_test")
        if not 0.0 < self.temperature <= 10.0:
            raise ConfigError(f"{key}.temperature must be in (0, 10] (sampling: 0 would give every reply of a group "
                              f"the same tokens), got {self.temperature}")


def check_benchmark_source(source: str, key: str) -> None:
    """'' | hub:<id>[:<config>] | an existing local file of a type `datasets` reads here."""
    if not source:
        return
    if source.startswith("hub:"):
        ident, _, config = source.removeprefix("hub:").partition(":")
        if not ident or ":" in config:
            raise ConfigError(f"{key}='{source}' must look like hub:<id>[:<config>], e.g. hub:allenai/ai2_arc:ARC-Easy")
        return
    if Path(source).suffix.lower() not in BENCHMARK_FILE_TYPES:
        raise ConfigError(f"{key}='{source}': a local source must be a {', '.join(BENCHMARK_FILE_TYPES)} file "
                          f"(or hub:<id>[:<config>])")
    if not Path(resolve_source(source)).is_file():
        raise ConfigError(f"{key}='{source}': no such file (a relative path starts at the project root, {ROOT})")


def resolve_source(source: str) -> str:
    """A benchmark source as the loader takes it: a relative path joined to the project root (where
    profiles/ is), so params.yaml means the same files from any working directory."""
    if source.startswith("hub:") or Path(source).is_absolute():
        return source
    return str(ROOT / source)


@dataclass
class RuntimeParams(Settings):
    """Where the training stages run: the device, compilation, and the processes and machines."""
    KEY: ClassVar[str] = "runtime"
    MINIMUM: ClassVar[dict[str, float]] = {"threads": 0, "nproc": 1, "nnodes": 1, "timeout_s": 1}
    device: str = "auto"
    """auto | cpu | cuda | cuda:N"""
    compile: Literal["auto", "on", "off"] = "auto"
    """auto (compile on CUDA) | on | off"""
    threads: int = 0
    """CPU threads for torch (0 = torch's default)."""
    nproc: int = 1
    """Processes (GPUs) per machine. With nproc > 1 or nnodes > 1 a training stage relaunches itself under
    torchrun; started by a launcher (torchrun, Slurm's srun, mpirun) it joins that job instead, and the
    launcher's layout wins over nproc, nnodes and node_rank."""
    nnodes: int = 1
    """Machines in the job. > 1 needs node_rank, rdzv_endpoint, and the project directory on a filesystem
    every machine mounts at the same path (README, "Several machines")."""
    node_rank: int = 0
    """This machine's rank, 0 .. nnodes-1. Node 0's first process is global rank 0: it writes the model
    directory, metrics and plots; every rank writes its part of an FSDP checkpoint."""
    rdzv_endpoint: str = ""
    """host:port of node 0, where the machines meet (torchrun's --master-addr/--master-port); also the
    address an srun or mpirun job meets at when the launcher does not set MASTER_ADDR/MASTER_PORT."""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """ddp (every rank holds the whole model; gradients all-reduced) | fsdp (FSDP2 `fully_shard`:
    weights, gradients and optimizer state sharded over the ranks; compute in the backend's dtype,
    fp32 master weights; checkpoints through torch.distributed.checkpoint, loadable by any rank count)."""
    timeout_s: int = 60
    """Seconds a collective waits for a peer before the process group fails: the longest a rank outlives
    one that vanished without closing its connections (a rank killed outright is noticed at once)."""
    memory_fit: Literal["fit", "check", "off"] = "fit"
    """On a GPU, before the first step (model/memory_fit.py): fit (a stage's device_batch is halved until
    the step's estimated peak fits the memory free at start; gradient accumulation keeps the total batch)
    | check (a device_batch that would not fit stops the stage, naming the value that fits) | off."""

    def check(self, key: str) -> None:
        super().check(key)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"{key}.device must be auto, cpu, cuda or cuda:N, got '{self.device}'")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"{key}.node_rank must be in 0..{self.nnodes - 1} (nnodes={self.nnodes}), "
                              f"got {self.node_rank}")
        if self.rdzv_endpoint or self.nnodes > 1:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                why = f" (where the {self.nnodes} machines of {key}.nnodes meet)" if self.nnodes > 1 else ""
                raise ConfigError(f"{key}.rdzv_endpoint must be host:port of node 0, e.g. spark-1:29500{why}; "
                                  f"got '{self.rdzv_endpoint}'")

    @property
    def master(self) -> tuple[str, int]:
        """(host, port) of rdzv_endpoint."""
        host, _, port = self.rdzv_endpoint.rpartition(":")
        return host.strip("[]"), int(port)


@dataclass
class Params(Settings):
    """params.yaml: one section per concern, each stage reading those STAGE_SECTIONS names."""
    profile: str = ""
    """Name of a file in profiles/ whose values override this file ('' = none)."""
    model: ModelParams = field(default_factory=ModelParams)
    data: DataParams = field(default_factory=DataParams)
    tokenizer: TokenizerParams = field(default_factory=TokenizerParams)
    precision: PrecisionParams = field(default_factory=PrecisionParams)
    runtime: RuntimeParams = field(default_factory=RuntimeParams)
    pretrain: TrainParams = field(default_factory=TrainParams)
    midtrain: TrainParams = field(default_factory=_default_mid)
    sft: TrainParams = field(default_factory=_default_sft)
    rl: RLParams = field(default_factory=RLParams)
    evaluate: EvaluateParams = field(default_factory=EvaluateParams)
    probe: ProbeOptions = field(default_factory=ProbeOptions)
    """`sparkchat probe` (model/precision/options.py ProbeOptions)."""

    def backend_for(self, stage: str) -> str:
        return getattr(self, stage).backend or self.precision.backend


# -- loading ---------------------------------------------------------------------------------------

def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of sections")
    return data


def params_from_dict(data: dict, profiles_dir: Path | None = None) -> Params:
    params = Params.from_dict(data, "")
    if params.profile:
        pdir = profiles_dir or ROOT / "profiles"
        path = pdir / f"{params.profile}.yaml"
        if not path.is_file():
            names = sorted(p.stem for p in pdir.glob("*.yaml"))
            raise ConfigError(f"profile '{params.profile}' not found: no {path} (profiles: {', '.join(names)})")
        overlay = _read_yaml(path)
        if "profile" in overlay:
            raise ConfigError(f"{path}: a profile cannot set 'profile'")
        params = Params.from_dict(overlay, "", base=params)
    return params


def load_params(path: str | Path = "params.yaml", stage: str | None = None) -> Params:
    """params.yaml with its profile applied and checked. With `stage`, only that stage's sections
    (STAGE_SECTIONS) can be read: any other raises ConfigError, so a stage cannot depend on a value
    DVC does not re-run it for."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} not found (run from the project root)")
    params = params_from_dict(_read_yaml(path), path.resolve().parent / "profiles")
    if stage is None:
        return params
    for f in dataclasses.fields(params):
        if f.name != "profile" and f.name not in STAGE_SECTIONS[stage]:
            setattr(params, f.name, _Undeclared(stage, f.name))
    return params


# The params.yaml sections each pipeline stage reads: the one home of this fact. The `params` stage
# (pipeline/params.py) writes each stage's sections, resolved with the selected profile, to
# `sparkchat.paths.stage_params(stage)`, which is that stage's dependency in dvc.yaml: a change to
# params.yaml or to the selected profile re-runs exactly the stages whose values it changes.
STAGE_SECTIONS = {
    "prepare": ("data", "model", "tokenizer", "pretrain"),  # model and pretrain size the token budget
    "tokenizer": ("tokenizer",),
    "pretrain": ("model", "precision", "runtime", "pretrain"),
    "midtrain": ("precision", "runtime", "midtrain"),
    "sft": ("precision", "runtime", "sft"),
    "rl": ("precision", "runtime", "rl"),
    "evaluate": ("runtime", "evaluate"),
}


class _Undeclared:
    """Stands in for a params section a stage does not declare; reading it is a bug in the stage."""

    def __init__(self, stage: str, section: str):
        self._where = (stage, section)

    def __getattr__(self, name):
        stage, section = self._where
        raise ConfigError(f"stage '{stage}' read {section}.{name}, but '{section}' is not among the sections it "
                          f"declares (pipeline/config.py STAGE_SECTIONS['{stage}']): add it there")


def steps_for_tokens(tokens: float, total_batch_tokens: int) -> int:
    return max(1, math.ceil(tokens / total_batch_tokens))
