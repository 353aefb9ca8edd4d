"""The on-disk format of a checkpoint folder: names, the index, digests and the errors.

A save writes every shard file under a name no earlier save used
(``shard-00000-of-00004-<save id>.safetensors``) and then replaces ``index.json`` in one atomic
step; the index names the files of exactly one save. So the folder always holds one complete
checkpoint: the previous one until the new index lands, the new one after.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import stat
from typing import Any, NamedTuple

# No framework at import time: the MindSpore backend writes this format too (numpy arrays).

__all__ = ["INDEX_FILE", "CheckpointError", "CorruptCheckpointError", "LoadResult",
           "read_index"]

from ._errors import INDEX_FILE, VERSION, CheckpointError, CorruptCheckpointError
from ._validate import check_index

FORMAT = "hyperpar-checkpoint"
DIGEST = "sha256"

#: Files a save may leave behind: shards (any save id, or none for version 1), index temps and
#: ``async_save``'s notes (:mod:`._async`).
_OWN_FILE = re.compile(r"^(shard-\d{5}-of-\d{5}(-[0-9a-f]+)?\.(safetensors|pt)"
                       r"|index\.json\.tmp[-.0-9a-z]*"
                       r"|\.hyperpar-async-[0-9a-f]+-(rank\d{5}|outcome)\.json(\.tmp)?)$")


class LoadResult(NamedTuple):
    """What ``load`` could not match, like ``torch.nn.Module.load_state_dict``'s result."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def shard_name(rank: int, world: int, save_id: str, file_format: str) -> str:
    ext = ".safetensors" if file_format == "safetensors" else ".pt"
    return f"shard-{rank:05d}-of-{world:05d}-{save_id}{ext}"


def is_checkpoint_file(name: str) -> bool:
    """True for the files a save writes (shards of any save, index temporaries)."""
    return bool(_OWN_FILE.match(name))


def dtype_name(dtype: Any) -> str:
    """The index's name of a dtype: torch's without the prefix (``float32``); numpy's and
    MindSpore's names of the common dtypes are the same strings."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> Any:
    """The torch dtype an index names."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"checkpoint index names an unknown dtype {name!r}")
    return dtype


def digest(t: Any) -> str:
    """sha256 of the raw bytes of host tensor ``t`` (any dtype, read in place, no numpy)."""
    t = t.contiguous()
    n = t.numel() * t.element_size()
    h = hashlib.sha256()
    if n:
        h.update(memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B"))
    return h.hexdigest()


def digest_array(a: Any) -> str:
    """sha256 of the raw bytes of numpy array ``a``: the same digest :func:`digest` gives the
    torch tensor with those bytes, so either framework checks the other's files."""
    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def read_index(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``index.json`` of checkpoint folder ``path``, its schema checked (a malformed
    index raises :class:`CheckpointError` naming the field)."""
    file = os.path.join(os.fspath(path), INDEX_FILE)
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file} does not exist: {os.fspath(path)!r} is not a hyperpar "
                                "checkpoint folder (written by hyperpar.checkpoint.save)")
    if not stat.S_ISREG(os.stat(file).st_mode):  # a FIFO would block open() forever
        raise CheckpointError(f"{file} is not a regular file (a FIFO, device or folder); "
                              "refusing to open it")
    try:
        with open(file) as f:
            index = json.load(f)
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{file} cannot be read as JSON: {exc}") from exc
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        got = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise CheckpointError(f"{file} is not a hyperpar checkpoint index (format={got!r}, "
                              f"expected {FORMAT!r})")
    version = index.get("version", 1)
    if isinstance(version, int) and version > VERSION:
        raise CheckpointError(f"{file} has format version {index['version']}; this hyperpar "
                              f"reads versions up to {VERSION}: upgrade hyperpar")
    check_index(os.fspath(path), index)  # every field's type and range: the index is untrusted
    return index


def write_index(path: str, index: dict[str, Any], save_id: str) -> None:
    """Make ``index`` the checkpoint of folder ``path`` in one atomic, durable step."""
    tmp = os.path.join(path, f"{INDEX_FILE}.tmp-{save_id}")
    with open(tmp, "w") as f:
        json.dump(index, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, INDEX_FILE))
    fsync_dir(path)


def fsync_dir(path: str) -> None:
    """Persist a folder's entries (a rename) where the OS allows opening folders."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
