"""``POST /v1/update_weights`` (``samebits serve --enable-weight-updates --weight-update-root
ROOT``): load HF-named safetensors from a directory inside ROOT and swap them in between requests.

Body ``{"path": "<dir>"}`` (relative to ROOT, or absolute inside it); answer
``{"system_fingerprint": "<new>"}``. The swap runs on the engine thread
(``AsyncEngine.update_weights``): admission pauses, requests in flight finish on the old weights,
then the new ones go in, so no request ever mixes the two. Any refusal is a 400 naming the
problem, and the weights stay exactly as they were.

What may be read (``WeightReader``):

- the directory must resolve (symlinks followed) inside ROOT; every path outside it, existing or
  not, gets the same answer, and messages name files only relative to ROOT;
- its files are those ``model.safetensors.index.json`` names (else its ``*.safetensors``); each,
  and the index, must resolve inside the directory and be a regular file, checked with
  ``os.stat`` before it is opened (a FIFO or device is never opened, so it cannot block), opened
  without following a symlink swapped in since, and the same inode as checked;
- all files together hold at most the model's own weight bytes plus a header allowance per file;
  they are read in a thread of their own within ``weight_update_timeout_s``;
- every floating-point tensor must be finite and within ``overflow_limit(dtype)`` (a value
  whose square overflows the dtype would overflow the matmuls it enters); the engine then checks
  names, shapes and dtypes (``samebits.models.weights.update_weights``).
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from samebits.server.errors import APIError
from samebits.server.metrics import Metrics
from samebits.server.serving import ServingContext

INDEX = "model.safetensors.index.json"
INDEX_MAX_BYTES = 16 * 1024 * 1024
HEADER_ALLOWANCE = 16 * 1024 * 1024  # bytes per file beyond its tensors (the JSON header)
_CHUNK = 16 * 1024 * 1024
_MAX_PATH = 4096
OUTSIDE = ("path must name a directory inside the server's weight-update root "
           "(--weight-update-root), relative to it or absolute")


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str


class UpdateWeightsResponse(BaseModel):
    system_fingerprint: str


def overflow_limit(dtype: torch.dtype) -> float:
    """The largest magnitude a weight of ``dtype`` may have: sqrt of the dtype's largest finite
    value (about 1.8e19 for float32 and bfloat16, 256 for float16)."""
    return float(torch.finfo(dtype).max) ** 0.5


def check_values(tensors: list[tuple[str, torch.Tensor]]) -> None:
    """A 400 naming the first floating-point tensor with a non-finite or overflowing value."""
    for name, t in tensors:
        if not t.is_floating_point() or t.numel() == 0:
            continue
        if not bool(torch.isfinite(t).all()):
            raise _bad(f"tensor {name!r} holds non-finite values (inf or nan)")
        peak, limit = float(t.abs().max()), overflow_limit(t.dtype)
        if peak > limit:
            raise _bad(f"tensor {name!r} holds a value of magnitude {peak:.3g}, beyond "
                       f"{limit:.3g} for {str(t.dtype).removeprefix('torch.')}: it would "
                       "overflow in use")


class WeightReader:
    """Reads one update's tensors under the rules of the module docstring (blocking: run it
    off the event loop). ``max_bytes``: the model's weight bytes."""

    def __init__(self, root: str, max_bytes: int, timeout_s: float) -> None:
        self.root, self.max_bytes, self.timeout_s = os.path.realpath(root), max_bytes, timeout_s

    def read(self, path: str) -> list[tuple[str, torch.Tensor]]:
        deadline = time.monotonic() + self.timeout_s
        directory = self._directory(path)
        files = self._files(directory, deadline)
        budget = self.max_bytes + HEADER_ALLOWANCE * len(files)
        size = sum(st.st_size for _, _, st in files)
        if size > budget:
            raise _bad(f"the weight files hold {size} bytes, more than this model's weights "
                       f"({self.max_bytes} bytes) and their headers")
        tensors: list[tuple[str, torch.Tensor]] = []
        for real, shown, st in files:
            data = _read_regular(real, shown, st, budget, deadline)
            try:
                tensors.extend(load_safetensors(data).items())
            except (SafetensorError, ValueError, RuntimeError) as e:
                raise _bad(f"{shown}: not a safetensors file ({_first_line(e)})") from None
        check_values(tensors)
        return tensors

    def _directory(self, path: str) -> str:
        if not path or "\x00" in path or len(path) > _MAX_PATH:
            raise _bad(OUTSIDE)
        real = os.path.realpath(os.path.join(self.root, os.path.expanduser(path)))
        if not _inside(real, self.root):
            raise _bad(OUTSIDE)  # the same answer whether it exists or not
        if not os.path.isdir(real):
            raise _bad(f"path {self._shown(real)!r} is not a directory inside the weight-update "
                       "root")
        return real

    def _shown(self, real: str) -> str:
        return os.path.relpath(real, self.root)

    def _files(self, directory: str, deadline: float) -> list[tuple[str, str, os.stat_result]]:
        """(real path, name shown in messages, stat) of every file the update reads."""
        if os.path.lexists(os.path.join(directory, INDEX)):
            real, st = _member(directory, INDEX, "the index")
            names = _shard_names(_read_regular(real, INDEX, st, INDEX_MAX_BYTES, deadline))
            what = "shard named by the index"
        else:
            try:
                names = sorted(e.name for e in os.scandir(directory)
                               if e.name.endswith(".safetensors"))
            except OSError as e:
                raise _bad(f"{self._shown(directory)} cannot be listed ({e.strerror})") from None
            what = "shard"
            if not names:
                raise _bad(f"{self._shown(directory)}: no *.safetensors files")
        files = []
        for name in names:
            real, st = _member(directory, name, what)
            files.append((real, name, st))
        return files


def _inside(path: str, parent: str) -> bool:
    return os.path.commonpath([path, parent]) == parent


def _member(directory: str, name: str, what: str) -> tuple[str, os.stat_result]:
    """The real path and stat of ``name`` in ``directory``: inside it and a regular file."""
    real = os.path.realpath(os.path.join(directory, name))
    if real == directory or not _inside(real, directory):
        raise _bad(f"{what} {name!r} is not inside the directory")
    try:
        st = os.stat(real)  # before any open: a FIFO or device is never opened
    except FileNotFoundError:
        raise _bad(f"{what} {name!r} is missing") from None
    except OSError as e:
        raise _bad(f"{what} {name!r} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise _bad(f"{what} {name!r} is not a regular file")
    return real, st


def _read_regular(real: str, shown: str, checked: os.stat_result, limit: int,
                  deadline: float) -> bytes:
    """The bytes of the regular file ``checked`` described (at most ``limit``), by ``deadline``."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(real, flags)
    except OSError as e:
        raise _bad(f"{shown} cannot be read ({e.strerror})") from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (checked.st_dev, checked.st_ino) or not stat.S_ISREG(
                st.st_mode):
            raise _bad(f"{shown} changed while it was being read")
        if st.st_size > limit:
            raise _bad(f"{shown} holds {st.st_size} bytes, more than this model's weights")
        chunks, size = [], 0
        while size < st.st_size:
            if time.monotonic() > deadline:
                raise _Timeout()
            chunk = f.read(min(_CHUNK, st.st_size - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)


def _shard_names(index: bytes) -> list[str]:
    try:
        weight_map = json.loads(index).get("weight_map")
    except (ValueError, AttributeError):
        raise _bad(f"{INDEX} is not a JSON object") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str)
                                                   for v in weight_map.values()):
        raise _bad(f"{INDEX}: 'weight_map' must map tensor names to file names")
    return sorted(set(weight_map.values()))


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _bad(message: str) -> APIError:
    return APIError(400, message, param="path", code="invalid_weights")


class _Timeout(Exception):
    pass


def model_bytes(ctx: ServingContext) -> int:
    """Bytes of the served model's weights (rank 0's full model under tensor parallel)."""
    model = ctx.engine.engine.loaded.model
    return sum(p.numel() * p.element_size() for p in model.parameters())


def add_route(router: APIRouter, ctx: ServingContext, metrics: Metrics, root: str,
              timeout_s: float,
              parse: Callable[[Request, type], Awaitable[UpdateWeightsRequest]]) -> None:
    reader = WeightReader(root, model_bytes(ctx), timeout_s)
    executor = ThreadPoolExecutor(1, thread_name_prefix="samebits-weights")
    busy = asyncio.Lock()

    @router.post("/update_weights")
    async def update_weights(request: Request) -> UpdateWeightsResponse:
        req = await parse(request, UpdateWeightsRequest)
        if busy.locked():
            raise APIError(409, "another weight update is in progress")
        async with busy:
            tensors = await _read(reader, executor, req.path, timeout_s)
            try:
                fingerprint = await ctx.engine.update_weights(tensors)
            except ValueError as e:
                raise APIError(400, str(e), param="path", code="invalid_weights") from None
            except RuntimeError as e:
                raise APIError(409, str(e)) from None
        ctx.fingerprint = fingerprint
        metrics.add_model(ctx.model_name, fingerprint)
        return UpdateWeightsResponse(system_fingerprint=fingerprint)


async def _read(reader: WeightReader, executor: ThreadPoolExecutor, path: str,
                timeout_s: float) -> list[tuple[str, torch.Tensor]]:
    loop = asyncio.get_running_loop()
    try:
        return await asyncio.wait_for(loop.run_in_executor(executor, reader.read, path),
                                      timeout_s)
    except (TimeoutError, _Timeout):
        raise _bad(f"the weight files could not be read within {timeout_s:g} s "
                   "(--weight-update-timeout)") from None
