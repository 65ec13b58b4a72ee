"""The one weight loader: Hugging Face tensor names <-> a model's (possibly fused) parameters.

Every model class declares, as nano-vllm does:

- ``packed_modules_mapping``: HF module name -> (fused module, shard index), e.g.
  ``"q_proj": ("qkv_proj", 0)``; a fused parameter holds its shards as row blocks, in shard order;
- ``hf_names(param_name) -> list[str]``: the HF tensor name of each shard of one parameter (one
  name for a plain parameter), and ``hf_ignored(name)``: checkpoint tensors that fill nothing
  (rotary tables, a tied LM head's copy, a BERT pooler).

A fused parameter carries ``shard_sizes`` (rows per shard) and a per-parameter ``weight_loader``
(``param.weight_loader(param, tensor, shard)``) that copies one shard in; plain parameters use
``default_weight_loader``. A tensor-parallel parameter's ``spec`` (``samebits.models.parallel``)
gives the full checkpoint shape behind its local shard, and its loader reads only this rank's
part of the checkpoint tensor, which may be a safetensors slice (nothing else is read). ``WeightMap``
joins the two directions, so loading a checkpoint, ``update_weights`` and ``named_weights`` all use
the same mapping; names and shapes are always the checkpoint's (whole) ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from samebits.config import ModelFormatError


def shard_view(param: torch.Tensor, shard: int | None, of: torch.Tensor | None = None
               ) -> torch.Tensor:
    """The rows of ``param`` (or of ``of``, a tensor shaped like it: its grad) that shard
    ``shard`` owns (all of it for a plain parameter)."""
    t = param.data if of is None else of
    if shard is None:
        return t
    sizes = param.shard_sizes
    return t.narrow(0, sum(sizes[:shard]), sizes[shard])


def default_weight_loader(param: torch.Tensor, tensor: Any, shard: int | None = None) -> None:
    shard_view(param, shard).copy_(tensor if isinstance(tensor, torch.Tensor) else tensor[:])


def tensor_shape(tensor: Any) -> tuple[int, ...]:
    """The shape of a tensor or of a safetensors slice (read from the file's header)."""
    return tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tuple(tensor.get_shape())


def fused_param(shard_sizes: list[int], *trailing: int) -> nn.Parameter:
    """A parameter of ``sum(shard_sizes)`` rows made of row-block shards, with its loader."""
    p = nn.Parameter(torch.empty(sum(shard_sizes), *trailing), requires_grad=False)
    p.shard_sizes = list(shard_sizes)
    p.weight_loader = default_weight_loader
    return p


def packed_hf_names(model: nn.Module, prefix: str, stem: str, suffix: str) -> list[str]:
    """HF names of the shards of fused ``stem`` (``qkv_proj``) from ``packed_modules_mapping``."""
    parts = sorted((shard, hf) for hf, (fused, shard) in model.packed_modules_mapping.items()
                   if fused == stem)
    return [f"{prefix}{hf}.{suffix}" for _, hf in parts]


@dataclass(frozen=True)
class Slot:
    param: str  # our parameter name (``named_parameters`` key)
    shard: int | None  # row block of a fused parameter, None for a plain one


class WeightMap:
    """Both directions between HF names and parameter slots of one model."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.slots: dict[str, Slot] = {}
        for pname, p in self.params.items():
            names = model.hf_names(pname)
            fused = hasattr(p, "shard_sizes")
            if fused and len(names) != len(p.shard_sizes):
                raise AssertionError(f"{pname}: {len(names)} names for {len(p.shard_sizes)} shards")
            for shard, hf in enumerate(names):
                self.slots[hf] = Slot(pname, shard if fused else None)

    def view(self, hf_name: str) -> torch.Tensor:
        """This rank's part of weight ``hf_name`` (the whole weight on one device)."""
        slot = self.slots[hf_name]
        return shard_view(self.params[slot.param], slot.shard)

    def full_shape(self, hf_name: str) -> tuple[int, ...]:
        """The checkpoint shape of weight ``hf_name`` (every rank's parts together)."""
        slot, shape = self.slots[hf_name], list(self.view(hf_name).shape)
        spec = getattr(self.params[slot.param], "spec", None)
        if spec is not None and spec.dim is not None:
            shape[spec.dim] = spec.full_sizes[slot.shard or 0]
        return tuple(shape)

    def gather(self, hf_name: str, group) -> torch.Tensor:
        """The whole weight ``hf_name``: every rank's part, in rank order (a collective of
        ``group``; a copy-free view on one device)."""
        slot = self.slots[hf_name]
        spec = getattr(self.params[slot.param], "spec", None)
        local = self.view(hf_name)
        if spec is None or spec.dim is None or group.world_size == 1:
            return local
        return group.gather_cat(local, spec.sizes(slot.shard or 0), dim=spec.dim)

    def write(self, hf_name: str, tensor: torch.Tensor) -> None:
        slot = self.slots[hf_name]
        param = self.params[slot.param]
        getattr(param, "weight_loader", default_weight_loader)(param, tensor, slot.shard)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, the tensor's current values as a view) for every weight, unfused."""
        for hf in self.slots:
            yield hf, self.view(hf)

    def named_grads(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(HF name, the gradient's rows for it, or None) for every weight."""
        for hf, slot in self.slots.items():
            p = self.params[slot.param]
            yield hf, None if p.grad is None else shard_view(p, slot.shard, p.grad)

    def check(self, hf_name: str, tensor: torch.Tensor) -> str | None:
        """What is wrong with ``tensor`` as the new value of ``hf_name``, or None."""
        if hf_name not in self.slots:
            return f"{hf_name!r} is not a weight of this model"
        dest, shape = self.view(hf_name), self.full_shape(hf_name)
        if tuple(tensor.shape) != shape:
            return f"{hf_name!r} has shape {tuple(tensor.shape)}, expected {shape}"
        if tensor.dtype != dest.dtype:
            return f"{hf_name!r} has dtype {tensor.dtype}, expected {dest.dtype}"
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"{hf_name!r} holds non-finite values (inf or nan)"
        return None


def hf_spelled(model: nn.Module, weights: Iterable[tuple[str, Any]]
               ) -> Iterable[tuple[str, Any]]:
    """(name, tensor) pairs in the model's own HF names, for loading and updating alike: its
    ``hf_weights`` where it has one (a mixture of experts: stacked experts split, Mixtral's
    spelling), else each name through its ``hf_rename`` (or as given)."""
    convert = getattr(model, "hf_weights", None)
    if convert is not None:
        return convert(weights)
    rename = getattr(model, "hf_rename", lambda n: n)
    return ((rename(name), t) for name, t in weights)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, Any]]) -> None:
    """Copy a whole checkpoint in: every weight exactly once, each with its exact (whole) shape;
    a weight is a tensor or a safetensors slice, of which only this rank's part is read."""
    wmap, written = WeightMap(model), set()
    for name, tensor in hf_spelled(model, weights):
        if name not in wmap.slots:
            if model.hf_ignored(name):
                continue
            raise ModelFormatError(f"checkpoint: unexpected tensor {name!r}")
        shape = wmap.full_shape(name)
        if tensor_shape(tensor) != shape:
            raise ModelFormatError(f"checkpoint: tensor {name!r} has shape "
                                   f"{tensor_shape(tensor)}, expected {shape}")
        wmap.write(name, tensor)
        written.add(name)
    missing = [n for n in wmap.slots if n not in written]
    if missing:
        raise ModelFormatError(f"checkpoint: no tensor for {missing[0]!r}"
                               + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


def update_weights(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]
                   ) -> list[tuple[str, torch.Tensor]]:
    """Validate every tensor first, then copy all in place (all or nothing); the checked list.

    Raises ``ValueError`` naming the first bad parameter; the model is then unchanged. It takes
    the names loading takes (``hf_spelled``); the checked list is in the model's own names.
    """
    wmap = WeightMap(model)
    items = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"update_weights: {name!r} is not a tensor")
    items = list(hf_spelled(model, items))
    seen: set[str] = set()
    for name, tensor in items:
        problem = wmap.check(name, tensor)
        if problem is None and name in seen:
            problem = f"{name!r} is given twice"
        if problem is not None:
            raise ValueError(f"update_weights: {problem}; no weight was changed")
        seen.add(name)
    with torch.no_grad():
        for name, tensor in items:
            wmap.write(name, tensor)
    return items
