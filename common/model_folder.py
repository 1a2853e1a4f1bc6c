"""The digest of a Hugging Face model folder, without torch (the control plane never loads it).

What a run trains from ``--model-dir`` is the folder's content, not its path: the digest
covers config.json and every weight file (``*.safetensors`` and the shard index), by name and
bytes, so two nodes hold the same weights exactly when their digests match.
"""

import hashlib
import os
from pathlib import Path

from fusionllm.common.errors import ConfigError

_CHUNK = 1 << 20


def model_folder_files(folder: Path) -> list[Path]:
    """config.json and the weight files, sorted by name."""
    if not folder.is_dir():
        raise ConfigError(f"model folder {folder} is not a directory")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model folder {folder} has no config.json")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise ConfigError(f"model folder {folder} has no *.safetensors weights")
    index = folder / "model.safetensors.index.json"
    extra = [index] if index.is_file() else []
    return sorted([folder / "config.json", *extra, *weights], key=lambda p: p.name)


def model_folder_digest(path: str | os.PathLike[str]) -> str:
    """sha256 (hex) over each file's name, size and bytes."""
    h = hashlib.sha256()
    for file in model_folder_files(Path(path).expanduser()):
        h.update(f"{file.name}\0{file.stat().st_size}\0".encode())
        with file.open("rb") as stream:
            while chunk := stream.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()
