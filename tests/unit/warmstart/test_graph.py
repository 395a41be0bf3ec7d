"""Tests for kiln.warmstart.graph: extraction on the meta device, op naming, JSON round trip."""

from __future__ import annotations

import importlib.util
import json
import warnings

import networkx as nx
import pytest
import torch
import torch.nn.functional as F
import torchvision.models as tvm
from torch import nn

from kiln import models
from kiln.warmstart import graph


class ShapeHeavy(nn.Module):
    """conv -> view/permute/flatten/dropout/identity/contiguous -> linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.drop = nn.Dropout(0.5)
        self.ident = nn.Identity()
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        b = y.size(0)
        y = y.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        y = self.ident(self.drop(y)).reshape(b, 4, 64)
        y = F.dropout(y.transpose(1, 2), 0.1, self.training).transpose(1, 2)
        return self.fc(torch.flatten(y, 1))


class TokenClassifier(nn.Module):
    """Text model with a learned position table used via get_attr, and q/k/v projections."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 16)
        self.positions = nn.Parameter(torch.zeros(1, 12, 16))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 16))
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.register_buffer("scale", torch.ones(1))
        self.head = nn.Linear(16, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.positions
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], dim=1)
        attn = F.scaled_dot_product_attention(self.q(h), self.k(h), self.v(h)) * self.scale
        unused = attn.sum()  # dead code: not part of the architecture
        del unused
        return self.head(attn[:, 0])


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # control flow on a tensor value: torch.fx cannot trace it
            return self.fc(x)
        return x


def _ops(g: nx.DiGraph) -> list[str]:
    return [a["op"] for _, a in g.nodes(data=True)]


def test_shape_and_bookkeeping_ops_are_dropped_and_bridged() -> None:
    g = graph.extract(ShapeHeavy(), [3, 8, 8], name="shape_heavy")
    assert _ops(g) == ["Conv2d", "Linear"]
    assert list(g.edges) == [("conv", "fc")]
    assert g.nodes["conv"]["out_shape"] == [1, 4, 8, 8]
    assert g.nodes["fc"]["weight_shape"] == [10, 256]
    assert g.nodes["fc"]["out_shape"] == [1, 10]


def test_get_attr_parameters_attach_to_their_consumer_and_text_uses_token_ids() -> None:
    g = graph.extract(TokenClassifier(), [12], name="token_classifier")
    nodes = dict(g.nodes(data=True))
    assert g.graph["input_dtype"] == "int64"
    add = next(a for a in nodes.values() if a["op"] == "add")
    assert add["params"] == ["positions"] and add["weight_shape"] == [1, 12, 16]
    cat = next(a for a in nodes.values() if a["op"] == "cat")
    assert cat["params"] == ["cls_token"] and cat["out_shape"] == [1, 13, 16]
    mul = next(a for a in nodes.values() if a["op"] == "mul")
    assert mul["buffers"] == ["scale"] and mul["weight_shape"] == []
    assert {"Linear_query", "Linear_key", "Linear_value", "Linear"} <= set(_ops(g))
    assert "sum" not in _ops(g)  # dead code dropped
    assert nx.is_directed_acyclic_graph(g)


def test_params_and_buffers_are_real_state_dict_keys() -> None:
    model = tvm.resnet18(num_classes=10)
    g = graph.extract(model, [3, 32, 32], name="resnet18")
    state = set(model.state_dict())
    params = {p for _, a in g.nodes(data=True) for p in a["params"]}
    buffers = {b for _, a in g.nodes(data=True) for b in a["buffers"]}
    assert params <= state and buffers <= state
    assert params == {k for k, _ in model.named_parameters()}
    assert buffers == {k for k, _ in model.named_buffers()}
    assert g.nodes["layer1_0_bn1"]["buffers"] == [
        "layer1.0.bn1.running_mean", "layer1.0.bn1.running_var",
        "layer1.0.bn1.num_batches_tracked"]


def test_extract_leaves_the_callers_model_untouched() -> None:
    model = tvm.resnet18(num_classes=10).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    graph.extract(model, [3, 32, 32])
    assert model.training
    after = model.state_dict()
    assert all(after[k].device.type == "cpu" and torch.equal(after[k], v)
               for k, v in before.items())


def test_resnet_graph_has_expected_layers_and_residual_joins() -> None:
    with torch.device("meta"):
        model = tvm.resnet18(num_classes=10)
    g = graph.extract(model, [3, 32, 32], name="resnet18")
    ops = _ops(g)
    assert ops.count("Conv2d") == 20 and ops.count("add") == 8 and ops[-1] == "Linear"
    assert sorted(g.predecessors("add")) == ["layer1_0_bn2", "maxpool"]
    assert g.nodes["fc"]["out_shape"] == [1, 10]
    assert "flatten" not in ops


def test_multihead_attention_weight_is_its_in_projection() -> None:
    with torch.device("meta"):
        model = tvm.vit_b_16(num_classes=10)
    g = graph.extract(model, [3, 224, 224], name="vit_b_16")
    mha = [a for _, a in g.nodes(data=True) if a["op"] == "MultiheadAttention"]
    assert len(mha) == 12 and mha[0]["weight_shape"] == [3 * 768, 768]


def test_untraceable_model_raises_graph_error_naming_the_architecture() -> None:
    with pytest.raises(graph.GraphError, match=r"data_dependent: torch\.fx cannot trace"):
        graph.extract(DataDependent(), [4], name="data_dependent", input_dtype=torch.float32)


def test_shape_mismatch_raises_graph_error_with_the_input_shape() -> None:
    with pytest.raises(graph.GraphError, match=r"meta input of shape \[1, 1, 32, 32\]"):
        graph.extract(tvm.resnet18(num_classes=10), [1, 32, 32], name="resnet18")


@pytest.mark.parametrize("shape", [[], [3, 0, 32]], ids=["empty", "zero"])
def test_invalid_input_shape_raises_graph_error(shape: list[int]) -> None:
    with pytest.raises(graph.GraphError, match="input_shape"):
        graph.extract(nn.Linear(2, 2), shape, name="linear")


def test_json_round_trip_preserves_nodes_attributes_edges_and_order() -> None:
    with torch.device("meta"):
        model = tvm.densenet121(num_classes=10)
    g = graph.extract(model, [3, 32, 32], name="densenet121")
    doc = json.loads(json.dumps(graph.to_json(g)))
    assert doc["schema_version"] == graph.SCHEMA_VERSION and doc["name"] == "densenet121"
    back = graph.from_json(doc)
    assert list(back.nodes(data=True)) == list(g.nodes(data=True))
    assert list(back.edges) == list(g.edges)
    assert back.graph == g.graph
    assert graph.to_json(back) == doc


def test_attention_projections_record_their_heads_through_json() -> None:
    model = models.get_model("vit", input_shape=(1, 8, 8), depth=1, width=32, heads=2,
                             patch_size=2, num_classes=10)
    g = graph.extract(model, [1, 8, 8])
    heads = {a["op"]: a.get("heads") for _, a in g.nodes(data=True) if "heads" in a}
    assert heads == {"Linear_query": 2, "Linear_key": 2, "Linear_value": 2}
    doc = graph.to_json(g)
    assert graph.to_json(graph.from_json(doc)) == doc
    # a graph written before heads were recorded still reads (the transform then maps the
    # projections k mod width)
    for node in doc["nodes"]:
        node.pop("heads", None)
    assert all("heads" not in a for _, a in graph.from_json(doc).nodes(data=True))
    query = next(n for n in doc["nodes"] if n["op"] == "Linear_query")
    query["heads"] = 0
    with pytest.raises(graph.GraphError, match="field 'heads' must be a positive int"):
        graph.from_json(doc)


@pytest.mark.parametrize(("mutate", "message"), [
    pytest.param(lambda d: d.update(schema_version=99), "schema_version 99", id="version"),
    pytest.param(lambda d: d["nodes"][0].pop("op"), "field 'op'", id="missing-field"),
    pytest.param(lambda d: d["nodes"][0].update(weight_shape=["4"]), "list of int", id="type"),
    pytest.param(lambda d: d["nodes"].append(d["nodes"][0]), "duplicate", id="duplicate"),
    pytest.param(lambda d: d["edges"].append(["conv", "nowhere"]), "known node", id="edge"),
    pytest.param(lambda d: d["edges"].append(["fc", "conv"]), "cycle", id="cycle"),
    pytest.param(lambda d: d["edges"].extend([["conv", "fc"]] * (graph.MAX_EDGES_PER_NODE
                                                                  * len(d["nodes"]))),
                 "edges per node", id="dense"),
])
def test_from_json_rejects_malformed_documents(mutate: object, message: str) -> None:
    doc = graph.to_json(graph.extract(ShapeHeavy(), [3, 8, 8], name="shape_heavy"))
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(graph.GraphError, match=message):
        graph.from_json(doc)


@pytest.mark.skipif(importlib.util.find_spec("kiln.models") is None,
                    reason="kiln.models not available yet")
def test_every_registry_model_yields_a_graph() -> None:
    from kiln import models

    failed = {}
    for name in models.list_models():
        info = models.get_info(name)
        shape = [3, 32, 32] if info.modality == models.Modality.IMAGE else [32]
        with torch.device("meta"):
            model = models.get_model(name, input_shape=shape)
        try:
            g = graph.extract(model, shape, name=name)
        except graph.GraphError as exc:  # allowed (the job cold-starts), but must say why
            assert str(exc).startswith(f"{name}: ")
            failed[name] = str(exc)
            continue
        assert g.number_of_nodes() > 0 and nx.is_directed_acyclic_graph(g)
        assert all(p in model.state_dict() for _, a in g.nodes(data=True) for p in a["params"])
    if failed:
        warnings.warn(f"registry models that cannot be warm-started: {failed}", stacklevel=1)
