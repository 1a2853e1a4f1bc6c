"""What a training run is, shared by every node of a swarm and by the stage runtime.

One spec, one meaning: ``micro_batch_size`` sequences of ``seq_len`` tokens per micro-batch,
``micro_batches`` per step, so a step trains ``global_batch`` sequences whatever the plan
(replicas split the micro-batches, stages split the model). It is part of the swarm settings'
digest: nodes that run another spec are never planned together. The data is in it by its
digest (``fusionllm.data.corpus``), never by its path: nodes may keep it anywhere, but must
hold the same tokens.
"""

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass

from fusionllm.common.errors import ConfigError

# The presets of dag/models/registry.py (common/ never imports torch; a unit test keeps them equal).
MODELS = ("tiny", "small", "medium", "large", "xl", "llama-tiny", "llama-1b")
GRADIENT_CODECS = ("topk", "ternary")
PRECISIONS = ("fp32", "bf16", "fp16")  # compute precision; weights and optimizer stay fp32
STDLIB_VOCAB = 256  # the built-in corpus is bytes
_DATA_DIGEST = re.compile(r"^([0-9a-f]{64})?$")
FOLDER = "folder"  # the model of a run that trains a Hugging Face folder (--model-dir)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    model: str = "tiny"  # a preset of the model registry
    seq_len: int = 64
    micro_batch_size: int = 2  # sequences per micro-batch
    micro_batches: int = 4  # per step
    steps: int = 200  # optimizer steps; 0: no end
    seed: int = 0  # model init and data order
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 1.0  # 0: no clipping
    gradient_codec: str = "topk"  # on links the plan compresses (error feedback either way)
    stdlib_bytes: int = 2 << 20  # how much of the standard library's source to train on
    # The corpus's digest (corpus.CorpusHasher). Empty: not pinned (library callers and tests
    # that build a RunSpec by hand); every node the command line starts pins it.
    data_digest: str = ""
    vocab_size: int = STDLIB_VOCAB  # the data's; token ids are below it
    # Validation loss on the held-out split at the start of every this many steps (0: never):
    # every stage takes part, so every node must agree.
    eval_every: int = 0

    # A Hugging Face folder instead of a preset (model FOLDER, --model-dir): the digest of its
    # files is shared by every node; where the folder lies is this node's own business.
    model_digest: str = ""
    model_dir: str | None = None  # never in a digest: see shared_fields
    precision: str = "fp32"  # autocast dtype of every stage's compute (PRECISIONS)
    # Fine-tuning with low-rank adapters (dag/models/lora.py): rank 0 trains every parameter;
    # else the base is frozen and only the adapters train (LoRA-FA: only their B).
    lora_rank: int = 0
    lora_alpha: float = 0.0  # 0: the rank
    lora_fa: bool = False
    lora_targets: tuple[str, ...] = ()  # module names; (): every linear layer of a block

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        if self.model not in (*MODELS, FOLDER):
            raise ConfigError(f"model must be one of {MODELS} or {FOLDER!r}, got {self.model!r}")
        digest_ok = isinstance(self.model_digest, str) and _SHA256.match(self.model_digest)
        if (self.model == FOLDER) != bool(digest_ok):
            raise ConfigError(
                f"model {FOLDER!r} and only it needs a model_digest (sha256 hex of the folder's "
                f"files); got model {self.model!r}, model_digest {self.model_digest!r}"
            )
        if self.model_dir is not None and self.model != FOLDER:
            raise ConfigError(f"model_dir is for model {FOLDER!r}, not {self.model!r}")
        if not isinstance(self.data_digest, str) or not _DATA_DIGEST.match(self.data_digest):
            raise ConfigError(
                f"data_digest must be 64 hex digits or empty, got {self.data_digest!r}"
            )
        for name in ("seq_len", "micro_batch_size", "micro_batches", "stdlib_bytes", "vocab_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ConfigError(f"eval_every must be an integer >= 0, got {self.eval_every!r}")
        if not isinstance(self.steps, int) or self.steps < 0:
            raise ConfigError(f"steps must be an integer >= 0 (0: no end), got {self.steps!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        numbers = (self.lr, self.weight_decay, self.max_grad_norm, *self.betas)
        if not all(isinstance(x, int | float) and math.isfinite(x) for x in numbers):
            raise ConfigError(f"optimizer settings must be finite numbers, got {numbers}")
        if not self.lr > 0 or self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ConfigError(
                f"need lr > 0, weight_decay >= 0, max_grad_norm >= 0; got {self.lr}, "
                f"{self.weight_decay}, {self.max_grad_norm}"
            )
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if self.gradient_codec not in GRADIENT_CODECS:
            raise ConfigError(
                f"gradient_codec must be one of {GRADIENT_CODECS}, got {self.gradient_codec!r}"
            )
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        self._check_lora()

    def _check_lora(self) -> None:
        rank, alpha = self.lora_rank, self.lora_alpha
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank <= 4096:
            raise ConfigError(f"lora_rank must be an integer in [0, 4096], got {rank!r}")
        if not isinstance(alpha, int | float) or not math.isfinite(alpha) or alpha < 0:
            raise ConfigError(f"lora_alpha must be a finite number >= 0, got {alpha!r}")
        if not isinstance(self.lora_fa, bool):
            raise ConfigError(f"lora_fa must be a boolean, got {self.lora_fa!r}")
        if not all(isinstance(t, str) and t for t in self.lora_targets):
            raise ConfigError(f"lora_targets must be module names, got {self.lora_targets!r}")
        if not rank and (alpha or self.lora_fa or self.lora_targets):
            raise ConfigError("LoRA settings (alpha, fa, targets) need lora_rank >= 1")

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.micro_batch_size * self.micro_batches

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def runs_forever(self) -> bool:
        return self.steps == 0

    @property
    def model_key(self) -> str:
        """The preset's name, or the folder's digest: what a cache of the model's costs is for."""
        return self.model if self.model != FOLDER else f"{FOLDER}-{self.model_digest[:16]}"

    def shared_fields(self) -> dict:
        """Every field but the node's own (``model_dir``): what digests of the run cover. A
        preset's run leaves out the empty ``model_digest`` too, and a run without adapters its
        LoRA fields, so its digests stay as they were before folders and adapters existed
        (checkpoints written then are still found)."""
        fields = {k: v for k, v in asdict(self).items() if k != "model_dir"}
        if not self.model_digest:
            del fields["model_digest"]
        if not self.lora_rank:  # a run that trains every parameter keeps its old digests
            for name in ("lora_rank", "lora_alpha", "lora_fa", "lora_targets"):
                del fields[name]
        return fields

    def lineage(self) -> str:
        """What makes two runs' states interchangeable: every shared field but ``steps`` (a
        run given more steps continues the same trajectory), as a short digest."""
        fields = {k: v for k, v in self.shared_fields().items() if k != "steps"}
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]
