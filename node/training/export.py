"""The way out: the stages' parameters that nodes left in their work dirs -> one HF folder.

A training node writes ``model-config.json`` (its run's model as Hugging Face's config.json,
and the run's lineage) into its work dir when it starts, ``final-params.pt`` (its stage's
parameters) when the run ends, and checkpoints under ``checkpoints/LINEAGE/`` while it runs.
``export`` assembles the final parameters of the newest finished plan, or else the newest
checkpointed step the work dirs cover between them, and writes ``config.json`` +
``model.safetensors`` that transformers loads as GPT2LMHeadModel or LlamaForCausalLM.
Copies (replicas, a tied embedding held by two stages) must be identical; a stage no work dir
holds is an ``ExportError`` that names it.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fusionllm.common.atomic import write_atomic
from fusionllm.common.errors import ConfigError, FusionError
from fusionllm.common.logs import get_logger
from fusionllm.dag.models import registry
from fusionllm.dag.models.hf_config import ModelConfig, config_from_hf, hf_config_of
from fusionllm.dag.models.hf_tensors import read_json
from fusionllm.dag.models.lora import LoraConfig, add_adapters, with_frozen_a
from fusionllm.dag.models.lora_io import adapter_shapes, save_adapters
from fusionllm.dag.models.pretrained import save_state
from fusionllm.node.training.checkpoints import CheckpointError, CheckpointStore

logger = get_logger(__name__)

MODEL_FILE = "model-config.json"
FINAL_PARAMS = "final-params.pt"  # the trainer's name for it (trainer.FINAL_PARAMS)


class ExportError(FusionError):
    """The work dirs do not hold one whole model: a stage is missing, or copies disagree."""


@dataclass(frozen=True)
class StageParams:
    """One node's parameters: a stage of a plan at a step (canonical name -> tensor)."""

    source: Path
    stage: int
    step: int
    plan: str
    params: dict[str, torch.Tensor]


def write_model_config(
    work_dir: Path,
    config: ModelConfig,
    lineage: str,
    *,
    like: dict | None = None,
    lora: dict | None = None,
) -> Path:
    """What ``export`` needs to read this node's files back (written when training starts);
    ``like``: the config.json of the folder the run started from (its token ids are kept);
    ``lora``: a fine-tune's adapters (``lora_record``), which export writes in PEFT's layout."""
    fields = {"lineage": lineage, "config": hf_config_of(config, like=like)}
    if lora is not None:
        fields["lora"] = lora
    text = json.dumps(fields, sort_keys=True)
    return write_atomic(Path(work_dir) / MODEL_FILE, text.encode())


def node_dirs(work_dirs: list[Path]) -> list[Path]:
    """The node work dirs in ``work_dirs``: each one itself, or (a swarm's) its subfolders."""
    found = []
    for folder in work_dirs:
        if not folder.is_dir():
            raise ExportError(f"{folder} is not a directory")
        if (folder / MODEL_FILE).is_file():
            found.append(folder)
        else:
            found += sorted(p for p in folder.iterdir() if (p / MODEL_FILE).is_file())
    if not found:
        raise ExportError(
            f"no node work dir (one with {MODEL_FILE}) in or below {[str(d) for d in work_dirs]}"
        )
    return found


def lora_record(lora: LoraConfig, seed: int, base: str | None) -> dict:
    """What export needs of a fine-tune: the adapters, the seed of their A, the base folder."""
    fields = {"rank": lora.rank, "alpha": lora.alpha, "fa": lora.fa, "targets": list(lora.targets)}
    return fields | {"seed": seed, "base": base}


def _lora_of(record: object) -> tuple[LoraConfig, int, str | None]:
    if not isinstance(record, dict) or not isinstance(record.get("seed"), int):
        raise ExportError(f"{MODEL_FILE}'s lora entry is malformed")
    try:
        lora = LoraConfig(
            rank=record.get("rank"), alpha=record.get("alpha"), fa=record.get("fa"),
            targets=tuple(record.get("targets") or ()),
        )  # fmt: skip
    except (ConfigError, TypeError) as exc:
        raise ExportError(f"{MODEL_FILE}'s lora entry is malformed: {exc}") from exc
    base = record.get("base")
    return lora, record["seed"], base if isinstance(base, str) else None


def model_of(dirs: list[Path]) -> tuple[ModelConfig, str, dict]:
    """The model config, lineage and the file's fields the nodes trained; all must agree."""
    seen = {}
    for folder in dirs:
        data = read_json(folder / MODEL_FILE, limit=1 << 20)
        seen[folder] = (json.dumps(data, sort_keys=True), data)
    if len({text for text, _ in seen.values()}) > 1:
        raise ExportError(f"the work dirs trained different runs: {sorted(map(str, seen))}")
    data = next(iter(seen.values()))[1]
    if not isinstance(data.get("lineage"), str) or not isinstance(data.get("config"), dict):
        raise ExportError(f"{MODEL_FILE} needs a lineage string and a config object")
    return config_from_hf(data["config"]), data["lineage"], data


def read_final_params(folder: Path) -> StageParams | None:
    path = folder / FINAL_PARAMS
    if not path.is_file():
        return None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)  # no pickled code runs
    except Exception as exc:  # torch raises many kinds on a damaged or foreign file
        raise ExportError(f"cannot read {path}: {exc}") from exc
    params = data.get("params") if isinstance(data, dict) else None
    stage, step = (data.get("stage"), data.get("step")) if isinstance(data, dict) else (0, 0)
    if stage is None:
        logger.info("%s was written by a node outside the final plan; not used", path)
        return None
    if (
        not isinstance(params, dict)
        or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in params.items())
        or not isinstance(stage, int)
        or not isinstance(step, int)
    ):
        raise ExportError(f"{path} is not a stage's final parameters")
    return StageParams(path, stage, step, str(data.get("plan", "")), params)


def merge(parts: list[StageParams], names: set[str]) -> dict[str, torch.Tensor]:
    """One tensor per name from the stages' parts; refuses disagreeing copies and gaps."""
    merged: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for part in parts:
        for name, tensor in part.params.items():
            if name not in names:
                raise ExportError(f"{part.source} holds {name!r}, which the model does not have")
            if name in merged and not torch.equal(merged[name], tensor):
                raise ExportError(f"{name} differs between {origin[name]} and {part.source}")
            merged.setdefault(name, tensor)
            origin.setdefault(name, part.source)
    missing = sorted(names - set(merged))
    if missing:
        stages = sorted({p.stage for p in parts})
        gaps = [s for s in range(max(stages) + 1) if s not in stages]
        which = f"stage {gaps[0]}" if gaps else f"the stage after stage {max(stages)}"
        raise ExportError(
            f"{which} is in no work dir (found stages {stages}): missing {len(missing)} "
            f"parameters, e.g. {missing[:3]}"
        )
    return merged


def _newest_final(parts: list[StageParams]) -> list[StageParams]:
    """The parts of the newest (step, plan): older final params are another run's leftovers."""
    step, plan = max((p.step, p.plan) for p in parts)
    return [p for p in parts if (p.step, p.plan) == (step, plan)]


def _from_checkpoints(dirs: list[Path], lineage: str, shapes: dict) -> list[StageParams]:
    """The parts of the newest step whose checkpoints (own or kept for others) cover every
    parameter."""
    by_step: dict[int, list[StageParams]] = {}
    stores = [
        CheckpointStore(d / kind / lineage) for d in dirs for kind in ("checkpoints", "custody")
    ]
    for store in stores:
        for holding in store.holdings():
            try:
                state = store.load(holding)
            except CheckpointError as exc:
                logger.warning("skipping a checkpoint: %s", exc)
                continue
            params = {
                name: flat[: torch.Size(shapes[name]).numel()].view(shapes[name])
                for name, flat in state.state.items()
                if name in shapes
            }
            # A checkpoint is a node range, not a stage: its first node stands in for the stage.
            part = StageParams(store.directory, holding.start, holding.step, state.plan, params)
            by_step.setdefault(holding.step, []).append(part)
    for step in sorted(by_step, reverse=True):
        if set(shapes) <= {n for p in by_step[step] for n in p.params}:
            return by_step[step]
    raise ExportError(f"no checkpointed step in {[str(d) for d in dirs]} covers the whole model")


def export(work_dirs: list[Path], out: Path) -> Path:
    """Write the run's model as a Hugging Face folder ``out`` (a fine-tune's: its adapters in
    PEFT's layout); returns ``out``."""
    dirs = node_dirs([Path(d) for d in work_dirs])
    config, lineage, fields = model_of(dirs)
    raw = fields["config"]
    lora = _lora_of(fields["lora"]) if "lora" in fields else None
    with torch.device("meta"):
        model = registry.build(config)
        if lora is not None:
            add_adapters(model, lora[0])
    # Trained parameters only (a fine-tune's adapters); a tied one under its first name.
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    finals = [p for p in map(read_final_params, dirs) if p is not None]
    parts = _newest_final(finals) if finals else _from_checkpoints(dirs, lineage, shapes)
    state = merge(parts, set(shapes))
    if lora is not None:
        adapters, seed, base = lora
        with torch.device("meta"):
            plain = registry.build(config)  # what the adapters' names and shapes are of
        every = with_frozen_a(adapter_shapes(plain, adapters), state, seed)
        return save_adapters(plain, adapters, every, out, base=base)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state[registry.architecture_of(config).embedding]
    logger.info("exporting step %d from %d parts to %s", parts[0].step, len(parts), out)
    return save_state(config, state, out, like=raw)
