"""A checkpoint is untrusted input: check an index and the files it names before reading a byte
of tensor data.

* paths: every file a checkpoint names resolves inside its folder (no absolute path, no ``..``,
  no symlink out) and is a regular file (a FIFO would block ``open`` forever);
* schema: every field of ``index.json`` has the type and range the writer gives it;
* sizes: each tensor is tiled by chunks inside its shape, so no allocation exceeds what the
  files hold;
* headers: each chunk's dtype, shape and byte length agree with the safetensors header of its
  file (the sha256 digest covers the bytes, not the header they are read with).

Not collective: callers share the outcome (``loader.agree_or_raise``).
"""

from __future__ import annotations

import json
import math
import os
import stat
from typing import Any

from ._errors import INDEX_FILE, VERSION, CheckpointError, CorruptCheckpointError

#: torch dtype name (as the index writes it) -> safetensors header code.
SAFETENSORS_DTYPE = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
    "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "complex64": "C64",
}
#: bytes per element of each dtype name (what an index written without torch may name)
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
            "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
            "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "complex64": 8,
            "complex128": 16}


def itemsize(name: str) -> int | None:
    """Bytes per element of dtype ``name`` (torch's names), None for no dtype: torch's
    answer where torch is installed, else the table above (a MindSpore-only install)."""
    try:
        import torch
    except ImportError:
        return ITEMSIZE.get(name)
    dtype = getattr(torch, name, None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else None


#: A safetensors header larger than this is refused before it is read (the format caps it).
MAX_HEADER_BYTES = 100 * 1024 * 1024


# ------------------------------------------------------------------ paths
def confined_file(folder: str, name: Any, *, what: str) -> str:
    """The full path of file ``name`` named by a checkpoint in ``folder``, after checking it
    stays inside ``folder`` and is a regular file; raises :class:`CheckpointError` otherwise."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{what} names file {name!r}: expected a non-empty relative path")
    if os.path.isabs(name) or (os.altsep and name.startswith(os.altsep)):
        raise CheckpointError(f"{what} names the absolute path {name!r}; a checkpoint may only "
                              f"name files inside its folder {folder}")
    parts = name.replace(os.altsep or os.sep, os.sep).split(os.sep)
    if ".." in parts or "\0" in name:
        raise CheckpointError(f"{what} names {name!r}, which climbs out of the checkpoint "
                              f"folder {folder} ('..'); refusing to read it")
    root = os.path.realpath(folder)
    full = os.path.join(folder, name)
    real = os.path.realpath(full)
    if os.path.commonpath([root, real]) != root:
        raise CheckpointError(f"{what} names {name!r}, a symlink to {real}, outside the "
                              f"checkpoint folder {folder}; refusing to read it")
    regular_file(full, what=what)
    return full


def regular_file(full: str, *, what: str) -> os.stat_result:
    """``os.stat`` of ``full`` after checking it exists and is a regular file."""
    try:
        st = os.stat(full)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{full} is missing: {what} names it; the checkpoint "
                                     "folder is incomplete") from None
    except OSError as exc:
        raise CorruptCheckpointError(f"{full} cannot be examined ({exc})") from exc
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{full} is not a regular file (a FIFO, device or folder): "
                              f"{what} names it; refusing to open it")
    return st


# ------------------------------------------------------------------ schema
def _ints(value: Any, *, n: int | None = None) -> bool:
    return (isinstance(value, list) and (n is None or len(value) == n)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _malformed(file: str, where: str, want: str, got: Any) -> CheckpointError:
    shown = repr(got)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return CheckpointError(f"{file} is malformed: {where} must be {want}, got {shown}; the "
                           "index was edited or not written by hyperpar.checkpoint.save")


def check_index(path: str, index: dict[str, Any]) -> None:
    """Check every field of ``index`` (types, ranges, which files it names) against what
    ``save`` writes. Files are not opened here (:func:`check_files` does that)."""
    file = os.path.join(path, INDEX_FILE)
    version = index.get("version", 1)
    if not _is_int(version) or not 1 <= version <= VERSION:
        raise _malformed(file, '"version"', f"an integer from 1 to {VERSION}", version)
    if index.get("file_format") not in ("safetensors", "torch"):
        raise _malformed(file, '"file_format"', "'safetensors' or 'torch'",
                         index.get("file_format"))
    files = index.get("files", {})
    if version >= 2 and "files" not in index:
        raise _malformed(file, '"files"', "an object (file name -> size)", None)
    if not isinstance(files, dict):
        raise _malformed(file, '"files"', "an object (file name -> size)", files)
    for name, meta in files.items():
        if not isinstance(meta, dict) or not _is_int(meta.get("bytes", 0)):
            raise _malformed(file, f'"files"[{name!r}]', 'an object with integer "bytes"', meta)
    if "tensors" not in index:
        raise _malformed(file, '"tensors"', "an object (tensor name -> entry)", None)
    tensors = index["tensors"]
    if not isinstance(tensors, dict):
        raise _malformed(file, '"tensors"', "an object (tensor name -> entry)", tensors)
    for key, entry in tensors.items():
        _check_entry(file, key, entry, files if version >= 2 else None)
    optimizer = index.get("optimizer")
    if optimizer is not None:
        _check_optimizer(file, optimizer)


def _check_entry(file: str, key: str, entry: Any, files: dict[str, Any] | None) -> None:
    where = f'"tensors"[{key!r}]'
    if not isinstance(entry, dict):
        raise _malformed(file, where, "an object", entry)
    shape = entry.get("shape")
    if not _ints(shape):
        raise _malformed(file, f"{where}.shape", "a list of non-negative integers", shape)
    dtype = entry.get("dtype")
    if not isinstance(dtype, str) or itemsize(dtype) is None:
        raise _malformed(file, f"{where}.dtype", "a torch dtype name such as 'float32'", dtype)
    chunks = entry.get("chunks")
    if not isinstance(chunks, list):
        raise _malformed(file, f"{where}.chunks", "a list", chunks)
    total = 0
    for i, chunk in enumerate(chunks):
        at = f"{where}.chunks[{i}]"
        if not isinstance(chunk, dict):
            raise _malformed(file, at, "an object", chunk)
        for field in ("file", "key"):
            if not isinstance(chunk.get(field), str):
                raise _malformed(file, f"{at}.{field}", "a string", chunk.get(field))
        offset, cshape = chunk.get("offset"), chunk.get("shape")
        if not _ints(offset, n=len(shape)):
            raise _malformed(file, f"{at}.offset", f"{len(shape)} non-negative integers", offset)
        if not _ints(cshape, n=len(shape)):
            raise _malformed(file, f"{at}.shape", f"{len(shape)} non-negative integers", cshape)
        if any(o + n > s for o, n, s in zip(offset, cshape, shape, strict=True)):
            raise _malformed(file, at, f"a box inside the tensor's shape {shape}",
                             {"offset": offset, "shape": cshape})
        if files is not None:
            if chunk["file"] not in files:
                raise _malformed(file, f"{at}.file", 'one of the files listed in "files"',
                                 chunk["file"])
            if not isinstance(chunk.get("digest"), str):
                raise _malformed(file, f"{at}.digest", "a sha256 hex string",
                                 chunk.get("digest"))
        total += math.prod(cshape)
    # Chunks are disjoint boxes (save writes each box once): they tile the tensor exactly. This
    # also bounds what load allocates by the bytes the files hold.
    if total != math.prod(shape):
        raise CheckpointError(
            f"{file} is malformed: the chunks of {key!r} hold {total} elements but its shape "
            f"{shape} has {math.prod(shape)}; the index was edited or the checkpoint is "
            "incomplete")


def _check_optimizer(file: str, optimizer: Any) -> None:
    if not isinstance(optimizer, dict):
        raise _malformed(file, '"optimizer"', "an object", optimizer)
    groups = optimizer.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise _malformed(file, '"optimizer".param_groups', "a list of objects", groups)
    if not isinstance(optimizer.get("scalars", {}), dict):
        raise _malformed(file, '"optimizer".scalars', "an object", optimizer.get("scalars"))
    keys = optimizer.get("tensors", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise _malformed(file, '"optimizer".tensors', "a list of tensor names", keys)
    cls = optimizer.get("class")
    if cls is not None and not isinstance(cls, str):
        raise _malformed(file, '"optimizer".class', "a class name", cls)
    params = optimizer.get("params")
    if params is not None and not (isinstance(params, list) and all(
            isinstance(g, list) and all(isinstance(n, str) for n in g) for g in params)):
        raise _malformed(file, '"optimizer".params', "a list of lists of parameter names",
                         params)
    hyper = optimizer.get("hyperparameters")   # a MindSpore optimizer's (optim_map names)
    if hyper is not None and not (isinstance(hyper, dict) and all(
            isinstance(v, (bool, int, float)) for v in hyper.values())):
        raise _malformed(file, '"optimizer".hyperparameters', "an object of numbers and "
                         "booleans", hyper)


# ------------------------------------------------------------------ files and headers
def check_files(path: str, index: dict[str, Any], *, part: tuple[int, int] = (0, 1)) -> None:
    """Every file the index names: inside ``path``, a regular file of the recorded size, and
    (safetensors) a header that agrees with each chunk's dtype, shape and byte length.

    ``part=(rank, world)`` checks only every ``world``-th file from the ``rank``-th (the ranks
    share the files, then agree on the outcome: each header is read once per load, not once
    per rank)."""
    by_file: dict[str, list[tuple[str, dict[str, Any], dict[str, Any]]]] = {}
    for key, entry in index["tensors"].items():
        for chunk in entry["chunks"]:
            by_file.setdefault(chunk["file"], []).append((key, entry, chunk))
    rank, world = part
    for name in sorted(set(index.get("files", {})) | set(by_file))[rank::world]:
        full = confined_file(path, name, what=f"{INDEX_FILE} of {path}")
        want = index.get("files", {}).get(name, {}).get("bytes")
        size = os.path.getsize(full)
        if want is not None and size != want:
            raise CorruptCheckpointError(
                f"{full} is {size} bytes but index.json says {want}: the file was truncated or "
                "overwritten after the save; restore it or save again")
        if index["file_format"] == "safetensors" and name in by_file:
            _check_header(full, size, by_file[name])


def read_safetensors_header(full: str, size: int) -> dict[str, Any]:
    """The JSON header of safetensors file ``full`` (of ``size`` bytes), bounds-checked."""
    if size < 8:
        raise CorruptCheckpointError(f"{full} is {size} bytes, too short for a safetensors "
                                     "file; it was truncated")
    with open(full, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise CorruptCheckpointError(f"{full}: its safetensors header claims {n} bytes but "
                                         f"the file has {size}; the file is damaged")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise CorruptCheckpointError(f"{full}: the safetensors header is not JSON ({exc}); "
                                         "the file is damaged") from exc
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{full}: the safetensors header is not an object")
    return {"data_bytes": size - 8 - n, "tensors": header}


def _check_header(full: str, size: int,
                  chunks: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> None:
    parsed = read_safetensors_header(full, size)
    header, data_bytes = parsed["tensors"], parsed["data_bytes"]
    for key, entry, chunk in chunks:
        name = chunk["key"]
        info = header.get(name)
        problem = None
        if not isinstance(info, dict):
            problem = f"has no tensor {name!r}"
        else:
            want_dtype = SAFETENSORS_DTYPE.get(entry["dtype"])
            offsets = info.get("data_offsets")
            nbytes = math.prod(chunk["shape"]) * (itemsize(entry["dtype"]) or 0)
            if want_dtype is not None and info.get("dtype") != want_dtype:
                problem = (f"stores {name!r} as {info.get('dtype')!r} but index.json says "
                           f"{entry['dtype']!r} ({want_dtype})")
            elif info.get("shape") != chunk["shape"]:
                problem = (f"stores {name!r} with shape {info.get('shape')} but index.json says "
                           f"{chunk['shape']}")
            elif not (_ints(offsets, n=2) and offsets[1] - offsets[0] == nbytes
                      and offsets[1] <= data_bytes):
                problem = (f"stores {name!r} in bytes {offsets} of {data_bytes}, not the "
                           f"{nbytes} bytes its dtype and shape need")
        if problem:
            raise CorruptCheckpointError(
                f"{full} {problem} (tensor {key!r}): the index and the file disagree, so the "
                "bytes would be read as the wrong type or shape; restore the checkpoint or "
                "save again")
