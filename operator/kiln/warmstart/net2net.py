"""Net2Net-style tensor operators: write a child's state_dict from its parent's, layer by layer.

Role: the half of `kiln.warmstart.transform` (rules in its module docstring) that writes
tensors, following the plan `transferplan` made from shapes. `Builder.transfer` copies one
aligned pair: the overlapping block with CENTRED kernel dims (`_paste`), input columns by unit
map divided by their replica count and output rows replicated with noise (Net2WiderNet, Chen
et al. ICLR '16), head rows copied where they overlap, biases and BatchNorm statistics with
their layer. `Builder.identity` initialises an inserted layer as the identity (Net2DeeperNet:
Dirac/eye, BatchNorm gamma 1, beta 0). It records what it wrote and why (`params`, `buffers`,
`identity_keys`, `notes`).

Callers: `transform` only. Non-goals: no planning (which maps, heads, identity layers:
`transferplan`), no graph walking, no I/O; inputs are never mutated. Shapes: O output units,
I input units (per group for grouped convs), k kernel dims.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from kiln.warmstart import transferplan

Tensor = torch.Tensor


class Builder:
    """The child's new state_dict plus the bookkeeping of what was written and why."""

    def __init__(self, parent_state: Mapping[str, Tensor], child_state: Mapping[str, Tensor],
                 *, noise_std: float, generator: torch.Generator | None) -> None:
        self.parent = parent_state
        self.child = child_state  # read only: the child's init
        self.new: dict[str, Tensor] = {}  # keys written so far
        self.noise_std = noise_std
        self.generator = generator
        self.params: list[str] = []
        self.buffers: list[str] = []
        self.identity_keys: list[str] = []
        self.notes: list[str] = []
        self.written: set[str] = set()

    def transfer(self, p_node: dict[str, Any], c_node: dict[str, Any], name: str, *,
                 in_map: transferplan.UnitMap | None, out_map: transferplan.UnitMap | None,
                 head: bool) -> None:
        """Copy one aligned pair's tensors into the child."""
        kind = transferplan.layer_kind(c_node)
        if kind == "dense" and transferplan.dense_keys(p_node, self.parent)[0] \
                and transferplan.dense_keys(c_node, self.child)[0]:
            self._dense(p_node, c_node, name, in_map=in_map, head=head)
            return
        for pk, ck in _pair_keys(p_node, c_node, self.parent, self.child):
            if ck in self.written:
                continue
            p, c = self._parent(pk, ck), self.child[ck].detach()
            if kind == "norm" and out_map and c.ndim == 1 and len(c) == len(out_map.index) \
                    and len(p) == out_map.parent_width:
                self._write(ck, p[list(out_map.index)], c_node)
            elif p.ndim == c.ndim:
                self._write(ck, _paste(c, p, centre_from=c.ndim), c_node)
            else:
                self.notes.append(f"{ck}: parent tensor {pk} has rank {p.ndim}, the child's "
                                  f"{c.ndim}; it keeps the child's init")

    def _dense(self, p_node: dict[str, Any], c_node: dict[str, Any], name: str, *,
               in_map: transferplan.UnitMap | None, head: bool) -> None:
        """Conv/Linear: centred kernels, input columns by map (divided), rows by k mod old."""
        (pw_key, pb_key), (cw_key, cb_key) = (transferplan.dense_keys(p_node, self.parent),
                                              transferplan.dense_keys(c_node, self.child))
        if cw_key in self.written:  # a shared (tied) weight, written through another node
            return
        c, p = self.child[cw_key].detach(), self._parent(pw_key, cw_key)
        if p.ndim != c.ndim:
            self.notes.append(f"{cw_key}: parent weight {list(p.shape)} and child weight "
                              f"{list(c.shape)} differ in rank; it keeps the child's init")
            return
        c_out, c_in, p_out, p_in = c.shape[0], c.shape[1], p.shape[0], p.shape[1]
        block = p
        if c.shape[2:] != p.shape[2:]:
            block = _paste(p.new_zeros((*p.shape[:2], *c.shape[2:])), p, centre_from=2)
        columns = transferplan.expand_columns(in_map, c_in, p_in)
        if columns is not None and columns != list(range(p_in)):
            # Net2WiderNet: replicas of an input unit share its fan-out equally.
            counts = torch.bincount(torch.tensor(columns), minlength=p_in).to(c.dtype)
            shape = (1, c_in) + (1,) * (c.ndim - 2)
            block = block[:, columns] / counts[columns].reshape(shape).to(block.device)
        elif c_in != p_in:  # truncate, or zero fan-in from inputs the parent never had
            block = _paste(block.new_zeros((p_out, c_in, *block.shape[2:])), block,
                           centre_from=c.ndim)
        if head:
            rows = min(c_out, p_out)
            weight = c.clone()
            weight[:rows] = block[:rows]
            if c_out != p_out:
                self.notes.append(
                    f"head {name} ({c_node['op']}): {p_out} -> {c_out} outputs; copied the "
                    f"{rows} overlapping rows, the other {max(0, c_out - p_out)} keep the "
                    "child's init")
        elif c_out <= p_out:
            weight = block[:c_out].clone() if block is p else block[:c_out]
        else:  # Net2WiderNet: unit k copies unit k mod p_out, plus noise to break symmetry
            index = [k % p_out for k in range(c_out)]
            weight = block[index]
            if self.noise_std > 0:
                scale = weight[p_out:].flatten(1).std(dim=1, unbiased=False) * self.noise_std
                noise = self._noise((c_out - p_out, *weight.shape[1:]), weight)
                weight[p_out:] += noise * scale.reshape(-1, *[1] * (c.ndim - 1))
        self._write(cw_key, weight, c_node)
        if cb_key is not None:
            if pb_key is not None:
                pb = self._parent(pb_key, cb_key)
                cb = self.child[cb_key].detach()
                if head:
                    rows = min(c_out, p_out)
                    bias = cb.clone()
                    bias[:rows] = pb[:rows]
                else:
                    bias = pb[[k % p_out for k in range(c_out)]]
                self._write(cb_key, bias, c_node)
            else:  # the parent computes no bias: zero it where the parent's units are
                bias = self.child[cb_key].detach().clone()
                bias[: c_out if not head else min(c_out, p_out)] = 0
                self.new[cb_key] = bias
        elif pb_key is not None:
            self.notes.append(f"{name}: the parent's bias {pb_key} is dropped (the child's "
                              "layer has none)")

    def identity(self, node: dict[str, Any]) -> None:
        """Identity-initialise one inserted layer (`transferplan.identity_plan` chose it)."""
        if transferplan.layer_kind(node) == "norm":
            values = {"weight": 1.0, "bias": 0.0, "running_mean": 0.0, "running_var": 1.0}
            for key in [*node["params"], *node.get("buffers", [])]:
                local = key.rsplit(".", 1)[-1]
                if local in values and key not in self.written:
                    self._set_identity(key, torch.full_like(self.child[key], values[local]))
            return
        w_key, b_key = transferplan.dense_keys(node, self.child)
        if w_key in self.written:
            return
        w = torch.zeros_like(self.child[w_key])
        out_units, per_group = w.shape[0], w.shape[1]
        units = torch.arange(out_units)
        centre = [torch.full_like(units, k // 2) for k in w.shape[2:]]
        w[(units, units % per_group, *centre)] = 1.0  # eye for Linear, Dirac for convs
        if self.noise_std > 0:
            fan_in = math.prod(w.shape[1:])
            w += self._noise(tuple(w.shape), w) * (self.noise_std / math.sqrt(fan_in))
        self._set_identity(w_key, w)
        if b_key is not None and b_key not in self.written:
            self._set_identity(b_key, torch.zeros_like(self.child[b_key]))

    def state_dict(self) -> dict[str, Tensor]:
        """The child's full state_dict: written tensors, and copies of the untouched ones."""
        return {k: self.new[k] if k in self.new else v.detach().clone()
                for k, v in self.child.items()}

    def _set_identity(self, key: str, value: Tensor) -> None:
        self.new[key] = value
        self.written.add(key)
        self.identity_keys.append(key)

    def _write(self, key: str, value: Tensor, node: dict[str, Any]) -> None:
        target = self.child[key]
        self.new[key] = value.to(device=target.device, dtype=target.dtype).contiguous()
        self.written.add(key)
        (self.params if key in node.get("params", []) else self.buffers).append(key)

    def _parent(self, key: str, child_key: str) -> Tensor:
        like = self.child[child_key]
        return self.parent[key].detach().to(device=like.device, dtype=like.dtype)

    def _noise(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        return torch.randn(shape, generator=self.generator).to(device=like.device,
                                                                dtype=like.dtype)


def _pair_keys(p_node: dict[str, Any], c_node: dict[str, Any], p_tensors: Mapping[str, Tensor],
                c_tensors: Mapping[str, Tensor]) -> list[tuple[str, str]]:
    """Pair the parent's and child's parameter/buffer keys of one node pair: by name relative
    to the node's module (`weight`, `running_var`, `in_proj_weight`), then leftovers in order
    when their ranks agree."""
    def local(node: dict[str, Any], tensors: Mapping[str, Tensor]) -> dict[str, str]:
        prefix = str(node.get("target", "")) + "."
        keys = [k for k in [*node.get("params", []), *node.get("buffers", [])] if k in tensors]
        return {k.removeprefix(prefix): k for k in keys}

    p_local, c_local = local(p_node, p_tensors), local(c_node, c_tensors)
    pairs = [(p_local[n], c_local[n]) for n in c_local if n in p_local]
    p_rest = [k for n, k in p_local.items() if n not in c_local]
    c_rest = [k for n, k in c_local.items() if n not in p_local]
    pairs += [(pk, ck) for pk, ck in zip(p_rest, c_rest)
              if p_tensors[pk].ndim == c_tensors[ck].ndim]
    return pairs


def _paste(dst: Tensor, src: Tensor, *, centre_from: int) -> Tensor:
    """A copy of `dst` with the overlapping block of `src` pasted in: from the origin in dims
    below `centre_from`, CENTRED in the others (kernel dims: a smaller kernel sits in the middle
    of a larger one, a larger one gives up its centre)."""
    out = dst.clone()
    to, take = [], []
    for k, (d, s) in enumerate(zip(dst.shape, src.shape)):
        n = min(d, s)
        at_d, at_s = ((d - n) // 2, (s - n) // 2) if k >= centre_from else (0, 0)
        to.append(slice(at_d, at_d + n))
        take.append(slice(at_s, at_s + n))
    out[tuple(to)] = src[tuple(take)]
    return out
