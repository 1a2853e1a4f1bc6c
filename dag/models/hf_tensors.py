"""The tensors of a Hugging Face folder: read checked, written atomically, always safetensors.

A folder is untrusted input. Before a tensor is loaded its name, dtype and shape are read from
the safetensors header and checked against what the model expects; then its values are checked
finite. The index of a sharded folder may only name plain files inside the folder. Pickled
weights (``pytorch_model.bin``) are never read: loading them would run code from the file.
"""

import json
import os
import re
import tempfile
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fusionllm.common.logs import get_logger
from fusionllm.dag.models.hf_errors import (
    CheckpointFolderError,
    MissingFileError,
    TensorShapeError,
    TensorValueError,
)

logger = get_logger(__name__)

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_CONFIG_BYTES = 1 << 20
MAX_INDEX_BYTES = 64 << 20
FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
_SHARD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\.safetensors$")
_LISTED = 5  # names quoted in an error message

Renamer = Callable[[str], str | None]  # a file's tensor name -> ours; None: a buffer we drop


def read_json(path: Path, *, limit: int) -> dict[str, Any]:
    """A JSON object from a file of at most ``limit`` bytes."""
    if not path.is_file():
        raise MissingFileError(f"{path} does not exist")
    size = path.stat().st_size
    if size > limit:
        raise CheckpointFolderError(f"{path} is {size} bytes; more than {limit} is refused")
    try:
        value = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointFolderError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise CheckpointFolderError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


def weight_files(folder: Path) -> dict[Path, set[str] | None]:
    """Each safetensors file to read -> the names the index puts in it (None: no index)."""
    if (folder / WEIGHTS).is_file():
        return {folder / WEIGHTS: None}
    if not (folder / INDEX).is_file():
        bins = sorted(p.name for p in folder.glob("*.bin")) if folder.is_dir() else []
        hint = f"; {bins[0]} is pickled and never read, convert it to safetensors" if bins else ""
        raise MissingFileError(f"{folder} has neither {WEIGHTS} nor {INDEX}{hint}")
    weight_map = read_json(folder / INDEX, limit=MAX_INDEX_BYTES).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointFolderError(f"{folder / INDEX} has no weight_map object")
    shards: dict[Path, set[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not _SHARD_NAME.match(shard):
            raise CheckpointFolderError(
                f"{INDEX} puts {name!r} in {shard!r}: a shard must be a plain "
                f"*.safetensors file name in the folder"
            )
        shards.setdefault(folder / shard, set()).add(name)
    for path in shards:
        if not path.is_file():
            raise MissingFileError(f"{path.name}, a shard {INDEX} names, is not in {folder}")
    return shards


def tensor_count(folder: Path) -> int:
    """How many tensors the folder's weight files hold (headers only)."""
    count = 0
    for path in weight_files(folder):
        with _opened(path) as file:
            count += len(file.keys())
    return count


@contextmanager
def _opened(path: Path) -> Iterator[Any]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as file:
            yield file
    except SafetensorError as exc:
        raise CheckpointFolderError(f"{path} is not a readable safetensors file: {exc}") from exc


def read_tensors(
    folder: Path,
    *,
    expected: Mapping[str, tuple[int, ...]],
    optional: frozenset[str],
    rename: Renamer,
    only: Collection[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Every expected tensor (plus any of ``optional`` the folder has) as float32, by our names;
    with ``only``, just those of them (a pipeline stage's), every header still checked.

    Raises ``TensorShapeError`` for a missing, unexpected, duplicated or misshapen tensor and
    ``TensorValueError`` for a non-float dtype or a non-finite value, before loading any values
    when the headers alone show the problem.
    """
    plan = _plan(folder, expected, optional, rename)  # our name -> (file, its name)
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for ours, (path, theirs) in plan.items():
        if only is not None and ours not in only:
            continue
        by_file.setdefault(path, []).append((ours, theirs))
    for path, names in by_file.items():
        with _opened(path) as file:
            for ours, theirs in names:
                tensor = file.get_tensor(theirs).to(torch.float32)
                if not torch.isfinite(tensor).all():
                    raise TensorValueError(f"{path.name}: {theirs} holds NaN or infinity")
                tensors[ours] = tensor
    logger.debug("read %d tensors from %d files in %s", len(tensors), len(by_file), folder)
    return tensors


def _plan(
    folder: Path,
    expected: Mapping[str, tuple[int, ...]],
    optional: frozenset[str],
    rename: Renamer,
) -> dict[str, tuple[Path, str]]:
    """Where each tensor is, after checking every header against ``expected``."""
    plan: dict[str, tuple[Path, str]] = {}
    unexpected, misshapen = [], []
    for path, listed in weight_files(folder).items():
        with _opened(path) as file:
            names = set(file.keys())
            if listed is not None and listed - names:
                missing = sorted(listed - names)[:_LISTED]
                raise TensorShapeError(f"{INDEX} puts {missing} in {path.name}, which lacks them")
            for theirs in sorted(names):
                ours = rename(theirs)
                if ours is None:
                    continue
                if ours in plan:
                    raise TensorShapeError(f"{ours} is in the folder twice ({theirs})")
                if ours not in expected and ours not in optional:
                    unexpected.append(theirs)
                    continue
                part = file.get_slice(theirs)
                if part.get_dtype() not in FLOAT_DTYPES:
                    raise TensorValueError(
                        f"{path.name}: {theirs} is {part.get_dtype()}; weights must be one of "
                        f"{sorted(FLOAT_DTYPES)}"
                    )
                shape, want = tuple(part.get_shape()), expected.get(ours)
                if want is not None and shape != want:
                    misshapen.append(f"{theirs} {list(shape)} (config: {list(want)})")
                plan[ours] = (path, theirs)
    _refuse_mismatch(folder, sorted(set(expected) - set(plan)), unexpected, misshapen)
    return plan


def _refuse_mismatch(folder: Path, missing: list, unexpected: list, misshapen: list) -> None:
    problems = [
        f"{what} {len(names)}: {names[:_LISTED]}{' ...' if len(names) > _LISTED else ''}"
        for what, names in (("missing", missing), ("unexpected", unexpected), ("shape", misshapen))
        if names
    ]
    if problems:
        raise TensorShapeError(f"{folder} does not match its config.json; " + "; ".join(problems))


def write_tensors(
    folder: Path, tensors: Mapping[str, torch.Tensor], *, name: str = WEIGHTS
) -> Path:
    """``folder/name`` (contiguous CPU copies), replacing any older one whole."""
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        plain = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        save_file(plain, tmp, metadata={"format": "pt"})
        with open(tmp, "rb") as written:  # on disk before the rename, as write_atomic does
            os.fsync(written.fileno())
        os.replace(tmp, folder / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return folder / name
