"""Reading boxes out of a checkpoint's shard files, checking sizes and digests on the way."""

from __future__ import annotations

import os
from typing import Any

import torch

from ._commit import regions
from ._format import CorruptCheckpointError, digest, dtype_of
from ._validate import confined_file


class Reader:
    """Opens the shard files named by an index lazily; every chunk read is checked against the
    digest the index records for it (version 2), and every file against its recorded size."""

    def __init__(self, path: str, index: dict[str, Any], *, verify: bool = True) -> None:
        self.path, self.file_format, self.verify = path, index["file_format"], verify
        self.files: dict[str, Any] = index.get("files", {})
        self._open: dict[str, Any] = {}

    def _handle(self, file: str) -> Any:
        handle = self._open.get(file)
        if handle is not None:
            return handle
        # Checked again here (load checks every file up front): ``verify`` and direct callers.
        full = confined_file(self.path, file, what=f"index.json of {self.path}")
        want = self.files.get(file, {}).get("bytes")
        size = os.path.getsize(full)
        if want is not None and size != want:
            raise CorruptCheckpointError(
                f"{full} is {size} bytes but index.json says {want}: the file was truncated or "
                "overwritten after the save; restore it or save again")
        try:
            if self.file_format == "safetensors":
                from safetensors import safe_open

                handle = safe_open(full, framework="pt")
            else:
                handle = torch.load(full, mmap=True, weights_only=True)
        except Exception as exc:
            raise CorruptCheckpointError(f"{full} cannot be opened as a {self.file_format} "
                                         f"file ({type(exc).__name__}: {exc})") from exc
        self._open[file] = handle
        return handle

    def read(self, chunk: dict[str, Any], region: tuple[slice, ...], *, key: str,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """``region`` of ``chunk`` (of saved tensor ``key``). With a digest, the whole chunk is
        read and checked first (at most one saved shard of one tensor in memory)."""
        file, name = chunk["file"], chunk["key"]
        handle = self._handle(file)
        full = os.path.join(self.path, file)
        try:
            if "digest" not in chunk or not self.verify:  # version 1: nothing to check
                # (safetensors headers were checked against the index before any read)
                if self.file_format == "safetensors":
                    return handle.get_slice(name)[region] if region else handle.get_tensor(name)
                part = handle[name]
                self._check_stored(part, chunk, key, dtype, full)
                return part[region]
            whole = handle.get_tensor(name) if self.file_format == "safetensors" else handle[name]
        except CorruptCheckpointError:
            raise
        except Exception as exc:
            raise CorruptCheckpointError(f"{full}: cannot read {name!r} of {key!r} "
                                         f"({type(exc).__name__}: {exc})") from exc
        self._check_stored(whole, chunk, key, dtype, full)
        if list(whole.shape) != list(chunk["shape"]) or digest(whole) != chunk["digest"]:
            raise CorruptCheckpointError(
                f"{full}: the bytes of {key!r} (chunk at offset {chunk['offset']}) do not match "
                "the sha256 digest in index.json: the file was modified after the save; restore "
                "it or save again")
        return whole[region]


    @staticmethod
    def _check_stored(t: Any, chunk: dict[str, Any], key: str, dtype: torch.dtype | None,
                      full: str) -> None:
        """The stored tensor has the dtype and shape the index promises (a torch-format file
        has no header to check up front)."""
        if not isinstance(t, torch.Tensor):
            raise CorruptCheckpointError(f"{full}: {chunk['key']!r} is a "
                                         f"{type(t).__name__}, not a tensor")
        if (dtype is not None and t.dtype != dtype) or list(t.shape) != list(chunk["shape"]):
            raise CorruptCheckpointError(
                f"{full}: {key!r} (chunk at offset {chunk['offset']}) is stored as {t.dtype} "
                f"{list(t.shape)} but index.json says {dtype} {chunk['shape']}: the index or "
                "the file was edited; restore the checkpoint or save again")


def assemble(entry: dict[str, Any], key: str, offset: list[int], shape: list[int],
             reader: Reader) -> torch.Tensor:
    """The box (``offset``, ``shape``) of saved tensor ``key``, from every chunk that overlaps."""
    dtype = dtype_of(entry["dtype"])
    out = torch.empty(shape, dtype=dtype)
    for chunk, src, dst in regions(entry, key, offset, shape):
        out[dst] = reader.read(chunk, src, key=key, dtype=dtype)
    return out
