"""The warm-start decision end to end: decided once with every check, applied as decided."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln import api, models
from kiln.warmstart import decision, graph, select
from kiln.zoo import records, store


def _job(architecture: str, args: dict[str, Any], shape: list[int], **warm: Any) -> api.TrainingJob:
    return api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "child"},
        "spec": {"model": {"architecture": architecture, "args": args, "inputShape": shape},
                 "dataset": {"name": "text" if len(shape) == 1 else "digits",
                             **({"path": "corpus.txt"} if len(shape) == 1 else {})},
                 "warmStart": warm},
    })


def _register(zoo: store.ObjectStore, job: api.TrainingJob, accuracy: float,
              seed: int = 0) -> tuple[records.ZooRecord, torch.nn.Module]:
    torch.manual_seed(seed)
    model = models.build(job.spec.model)
    info = models.get_info(job.spec.model.architecture)
    record = records.ZooRecord(
        id=records.new_id(job.spec.model.architecture), architecture=job.spec.model.architecture,
        args=dict(job.spec.model.args), input_shape=tuple(job.spec.model.input_shape),
        modality=str(info.modality), task=str(info.task), dataset=str(job.spec.dataset.name),
        metric_name="validation_accuracy", metric_value=accuracy, validation_accuracy=accuracy,
        validation_loss=0.1, samples_per_second=100.0,
        num_params=sum(p.numel() for p in model.parameters()),
        created_time="2026-11-30T00:00:00Z", job_name="parent",
        job_spec=api.to_wire(job.spec), parent=None, similarity=None, weights_sha256="")
    saved = records.write_record(zoo, record, model.state_dict(),
                                 graph.to_json(decision.model_graph(job.spec.model)))
    return saved, model


SMALL = ("small_resnet", {"blocks": [1, 1, 1], "width": 8}, [1, 8, 8])
DEEPER = ("small_resnet", {"blocks": [2, 2, 2], "width": 8}, [1, 8, 8])


@pytest.fixture
def zoo(tmp_path: Path) -> store.DirStore:
    return store.DirStore(tmp_path / "zoo")


def test_the_most_similar_compatible_model_becomes_the_parent(zoo: store.DirStore) -> None:
    small, _ = _register(zoo, _job(*SMALL), accuracy=0.95)
    _register(zoo, _job("small_cnn", {"depth": 2, "width": 8}, [1, 8, 8]), accuracy=0.99)
    _register(zoo, _job("char_transformer", {"depth": 1, "width": 32, "heads": 2}, [16]),
              accuracy=0.5)
    decided = decision.decide(_job(*DEEPER), zoo)
    assert decided.parent == small.id
    assert decided.outcome == api.WarmStartOutcome.WARM
    assert decided.similarity is not None and decided.similarity > 0.3
    assert small.id in decided.reason


def test_an_empty_zoo_means_a_cold_start_saying_so(zoo: store.DirStore) -> None:
    decided = decision.decide(_job(*DEEPER), zoo)
    assert decided.cold_start and "empty" in decided.reason


def test_a_zoo_of_other_modalities_means_a_cold_start_naming_them(zoo: store.DirStore) -> None:
    _register(zoo, _job("char_transformer", {"depth": 1, "width": 32, "heads": 2}, [16]),
              accuracy=0.5)
    decided = decision.decide(_job(*DEEPER), zoo)
    assert decided.outcome == api.WarmStartOutcome.COLD_INCOMPATIBLE
    assert ("none of the 1 zoo models visible to namespace default is a image classification "
            "model") in decided.reason


def test_below_min_similarity_the_job_starts_cold_with_the_numbers(zoo: store.DirStore) -> None:
    _register(zoo, _job(*SMALL), accuracy=0.95)
    decided = decision.decide(_job(*DEEPER, minSimilarity=0.99), zoo)
    assert decided.outcome == api.WarmStartOutcome.COLD_BELOW_MIN_SIMILARITY
    assert "< minSimilarity 0.99" in decided.reason


def test_disabled_warm_start_never_reads_the_zoo(tmp_path: Path) -> None:
    unreadable = store.DirStore(tmp_path / "missing")
    decided = decision.decide(_job(*DEEPER, enabled=False), unreadable)
    assert decided.outcome == api.WarmStartOutcome.DISABLED
    assert decided.condition_reason == api.Reason.WARM_START_DISABLED


def test_a_missing_pinned_parent_is_an_invalid_spec_naming_the_field(
    zoo: store.DirStore,
) -> None:
    with pytest.raises(api.InvalidSpec, match=r"spec\.warmStart\.parent: no usable zoo model"):
        decision.decide(_job(*DEEPER, parent="small_resnet-00000000"), zoo)


def test_a_pinned_parent_is_used_even_below_min_similarity(zoo: store.DirStore) -> None:
    small, _ = _register(zoo, _job(*SMALL), accuracy=0.95)
    decided = decision.decide(_job(*DEEPER, parent=small.id, minSimilarity=0.99), zoo)
    assert decided.parent == small.id and decided.outcome == api.WarmStartOutcome.PINNED
    assert "pinned" in decided.reason


def test_apply_seeds_a_deeper_child_that_computes_what_its_parent_computes(
    zoo: store.DirStore,
) -> None:
    _, parent_model = _register(zoo, _job(*SMALL), accuracy=0.95)
    child_job = _job(*DEEPER)
    child = models.build(child_job.spec.model)
    decided = decision.decide(child_job, zoo)
    assert decided.matched_tensors and decided.total_tensors
    applied = decision.apply(decided, zoo, child, child_job.spec.model.input_shape)
    assert applied.state_dict is not None
    assert applied.untransferred_fraction == pytest.approx(
        1 - decided.matched_tensors / decided.total_tensors)
    assert 0.0 < applied.untransferred_fraction < 1.0
    child.load_state_dict(applied.state_dict)
    x = torch.randn(4, 1, 8, 8)
    parent_model.eval(), child.eval()
    # small_resnet's new blocks end in a zero-initialised BN, so they start as identities.
    torch.testing.assert_close(child(x), parent_model(x), atol=1e-4, rtol=1e-4)


def test_a_corrupted_parent_is_decided_a_cold_start_not_a_crash(zoo: store.DirStore,
                                                                  tmp_path: Path) -> None:
    small, _ = _register(zoo, _job(*SMALL), accuracy=0.95)
    weights = tmp_path / "zoo" / "models" / small.id / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10] + b"0123456789")
    decided = decision.decide(_job(*DEEPER), zoo)
    assert decided.cold_start and decided.outcome == api.WarmStartOutcome.COLD_UNREADABLE_PARENT
    assert small.id in decided.reason


def _damage(weights: Path) -> None:
    """Flip the file's last bytes: it no longer matches its recorded sha256."""
    weights.write_bytes(weights.read_bytes()[:-10] + b"0123456789")


def test_a_damaged_best_parent_is_skipped_for_the_next_one_saying_why(
    zoo: store.DirStore, tmp_path: Path
) -> None:
    damaged, _ = _register(zoo, _job(*SMALL), accuracy=0.99, seed=0)
    sound, _ = _register(zoo, _job(*SMALL), accuracy=0.90, seed=1)
    assert decision.decide(_job(*DEEPER), zoo).parent == damaged.id  # the policy's first
    _damage(tmp_path / "zoo" / "models" / damaged.id / "weights.safetensors")
    decided = decision.decide(_job(*DEEPER), zoo)
    assert decided.parent == sound.id and decided.outcome == api.WarmStartOutcome.WARM
    assert f"skipped unusable parent {damaged.id}" in decided.reason
    assert "sha256" in decided.reason  # why it was skipped


def test_parents_tried_are_bounded_and_all_named(zoo: store.DirStore, tmp_path: Path) -> None:
    ids = [_register(zoo, _job(*SMALL), accuracy=0.9 + i / 100, seed=i)[0].id for i in range(4)]
    for model_id in ids:
        _damage(tmp_path / "zoo" / "models" / model_id / "weights.safetensors")
    decided = decision.decide(_job(*DEEPER), zoo)
    assert decided.cold_start and decided.outcome == api.WarmStartOutcome.COLD_UNREADABLE_PARENT
    named = [model_id for model_id in ids if model_id in decided.reason]
    assert len(named) == decision.MAX_PARENT_TRIES


def test_a_damaged_only_candidate_is_a_cold_start_naming_it(
    zoo: store.DirStore, tmp_path: Path
) -> None:
    small, _ = _register(zoo, _job(*SMALL), accuracy=0.95)
    _damage(tmp_path / "zoo" / "models" / small.id / "weights.safetensors")
    decided = decision.decide(_job(*DEEPER), zoo)
    assert decided.cold_start and decided.outcome == api.WarmStartOutcome.COLD_UNREADABLE_PARENT
    assert "no other candidate" in decided.reason and small.id in decided.reason


def test_the_ten_percent_rule_is_part_of_the_decision(zoo: store.DirStore) -> None:
    small, _ = _register(zoo, _job(*SMALL), accuracy=0.95)
    other = _job("char_transformer", {"depth": 1, "width": 32, "heads": 2}, [16],
                 parent=small.id)
    decided = decision.decide(other, zoo)
    assert decided.outcome == api.WarmStartOutcome.COLD_FEW_TENSORS and decided.cold_start
    assert decided.total_tensors and "below the 10% minimum" in decided.reason


def test_a_decision_is_applied_as_decided_even_if_the_zoo_changed_since(
    zoo: store.DirStore,
) -> None:
    small, _ = _register(zoo, _job(*SMALL), accuracy=0.95)
    child_job = _job(*DEEPER)
    cold = decision.decide(child_job, store.DirStore(zoo.root.parent / "empty"))
    assert cold.cold_start
    child = models.build(child_job.spec.model)
    applied = decision.apply(cold, zoo, child, child_job.spec.model.input_shape)
    assert applied.state_dict is None and applied.untransferred_fraction == 1.0
    warm = decision.decide(child_job, zoo)
    records.delete_record(zoo, small.id)
    with pytest.raises(decision.ApplyError, match=small.id):
        decision.apply(warm, zoo, child, child_job.spec.model.input_shape, reread_delays=())


class _Rewriting(store.DirStore):
    """A zoo whose record `hidden` is missing for the next `misses` reads of its metadata,
    as while a running job rewrites its provisional record."""

    def __init__(self, root: Path, hidden: str, misses: int) -> None:
        super().__init__(root)
        self.hidden, self.misses = hidden, misses

    def get_bytes(self, key: str) -> bytes:
        if key == records.record_prefix(self.hidden) + records.META_NAME and self.misses:
            self.misses -= 1
            raise store.ObjectNotFound(key, self.describe())
        return super().get_bytes(key)


def test_a_parent_being_rewritten_is_read_again_before_the_job_gives_up(
        zoo: store.DirStore) -> None:
    small, _ = _register(zoo, _job(*SMALL), accuracy=0.95)
    child_job = _job(*DEEPER)
    warm = decision.decide(child_job, zoo)
    child = models.build(child_job.spec.model)
    rewriting = _Rewriting(zoo.root, small.id, misses=2)
    applied = decision.apply(warm, rewriting, child, child_job.spec.model.input_shape,
                             reread_delays=(0.0, 0.0))
    assert applied.state_dict is not None and rewriting.misses == 0
    rewriting = _Rewriting(zoo.root, small.id, misses=3)  # longer than the rereads: it fails
    with pytest.raises(decision.ApplyError, match=f"{small.id} is unusable now"):
        decision.apply(warm, rewriting, child, child_job.spec.model.input_shape,
                       reread_delays=(0.0, 0.0))


def test_a_decision_round_trips_through_json(zoo: store.DirStore) -> None:
    _register(zoo, _job(*SMALL), accuracy=0.95)
    decided = decision.decide(_job(*DEEPER), zoo)
    doc = json.loads(decided.model_dump_json())
    assert api.WarmStartDecision.model_validate(doc) == decided
    with pytest.raises(ValueError, match="warm-start decision: outcome: Input should be 'warm'"):
        select.from_report({**doc, "outcome": "lukewarm"})
    with pytest.raises(ValueError, match="similarity: Input should be less than or equal to 1"):
        select.from_report({**doc, "similarity": 1.5})


PLAIN = ("small_cnn", {"depth": 3, "width": 8}, [1, 8, 8])
TWO_STAGES = ("small_resnet", {"blocks": [1, 1], "width": 8}, [1, 8, 8])  # PLAIN's closest


def test_a_plain_child_passes_over_residual_parents_for_a_plain_one(zoo: store.DirStore) -> None:
    resnet, _ = _register(zoo, _job(*TWO_STAGES), accuracy=0.99)
    plain, _ = _register(zoo, _job("small_cnn", {"depth": 2, "width": 8}, [1, 8, 8]),
                         accuracy=0.90)
    decided = decision.decide(_job(*PLAIN), zoo)
    assert decided.parent == plain.id and decided.outcome == api.WarmStartOutcome.WARM
    assert f"passed over {resnet.id} (another family: the parent merges branches" in \
        decided.reason
    assert resnet.id not in decided.alternatives


def test_only_parents_of_another_family_mean_a_cold_start_saying_why(
        zoo: store.DirStore) -> None:
    resnet, _ = _register(zoo, _job(*TWO_STAGES), accuracy=0.99)
    decided = decision.decide(_job(*PLAIN), zoo)
    assert decided.cold_start and decided.outcome == api.WarmStartOutcome.COLD_OTHER_FAMILY
    assert decided.reason.startswith(f"cold start: passed over {resnet.id} (another family")
    assert "the child is a plain stack" in decided.reason
    # The converse: a residual child refuses a plain parent too.
    zoo_cold = decision.decide(_job(*TWO_STAGES), _only(zoo, "small_cnn", PLAIN))
    assert zoo_cold.outcome == api.WarmStartOutcome.COLD_OTHER_FAMILY
    assert "the child merges branches" in zoo_cold.reason


def _only(zoo: store.DirStore, architecture: str, shape: tuple[str, dict[str, Any], list[int]]
          ) -> store.DirStore:
    """A fresh zoo beside `zoo` holding one model of `architecture`."""
    other = store.DirStore(zoo.root.parent / f"zoo-{architecture}")
    _register(other, _job(*shape), accuracy=0.9)
    return other


def test_a_pinned_parent_of_another_family_is_still_used(zoo: store.DirStore) -> None:
    resnet, _ = _register(zoo, _job(*SMALL), accuracy=0.99)
    decided = decision.decide(_job(*PLAIN, parent=resnet.id), zoo)
    assert decided.parent == resnet.id and decided.outcome == api.WarmStartOutcome.PINNED


def test_merges_count_residual_joins_with_and_without_projection() -> None:
    from kiln.warmstart import match
    assert match.merges(decision.model_graph(_job(*PLAIN).spec.model)) == 0
    assert match.merges(decision.model_graph(_job(*SMALL).spec.model)) == 3  # one per block
    assert match.merges(decision.model_graph(_job(*DEEPER).spec.model)) == 6


# ----------------------------------------------------------------------------------------------
# tenancy and provenance


def _in(job: api.TrainingJob, namespace: str) -> api.TrainingJob:
    return job.model_copy(update={"metadata": job.metadata.model_copy(
        update={"namespace": namespace})})


def _owned(zoo: store.ObjectStore, saved: records.ZooRecord, namespace: str,
           share: api.ZooShare) -> records.ZooRecord:
    """`saved`, rewritten as a record of `namespace` with `share`."""
    weights, parent_graph = records.load_weights(zoo, saved), records.load_graph(zoo, saved)
    records.delete_record(zoo, saved.id)
    changed = dataclasses.replace(saved, namespace=namespace, share=share)
    return records.write_record(zoo, changed, weights, parent_graph)


def test_a_job_never_warm_starts_from_another_namespaces_private_model(
        zoo: store.DirStore) -> None:
    theirs, _ = _register(zoo, _in(_job(*SMALL), "team-a"), accuracy=0.95)
    _owned(zoo, theirs, "team-a", api.ZooShare.PRIVATE)
    assert decision.decide(_in(_job(*DEEPER), "team-a"), zoo).parent == theirs.id
    decided = decision.decide(_in(_job(*DEEPER), "team-b"), zoo)
    assert decided.cold_start and decided.outcome == api.WarmStartOutcome.COLD_EMPTY
    with pytest.raises(api.InvalidSpec, match=f"{theirs.id}' is private to namespace team-a, "
                       "and this job runs in team-b"):
        decision.decide(_in(_job(*DEEPER, parent=theirs.id), "team-b"), zoo)


def test_a_shared_model_seeds_jobs_of_every_namespace(zoo: store.DirStore) -> None:
    theirs, _ = _register(zoo, _job(*SMALL), accuracy=0.95)
    _owned(zoo, theirs, "team-a", api.ZooShare.SHARED)
    assert decision.decide(_in(_job(*DEEPER), "team-b"), zoo).parent == theirs.id
    pinned = decision.decide(_in(_job(*DEEPER, parent=theirs.id), "team-b"), zoo)
    assert pinned.outcome == api.WarmStartOutcome.PINNED


def test_within_a_bucket_a_parent_trained_on_the_same_data_wins(zoo: store.DirStore) -> None:
    child = _job(*DEEPER)
    _register(zoo, _job(*SMALL), accuracy=0.99, seed=1)  # better, but no fingerprint
    same, _ = _register(zoo, _job(*SMALL), accuracy=0.90, seed=2)
    fingerprint = records.dataset_fingerprint(child.spec.dataset)
    weights, parent_graph = records.load_weights(zoo, same), records.load_graph(zoo, same)
    records.delete_record(zoo, same.id)
    same = records.write_record(zoo, dataclasses.replace(same, dataset_fingerprint=fingerprint),
                                weights, parent_graph)
    decided = decision.decide(child, zoo)
    assert decided.parent == same.id
    assert f"trained on the same dataset (spec fingerprint {fingerprint}; 1 of 2 were)" in (
        decided.reason)


def test_a_parent_with_the_same_content_as_a_same_spec_model_counts_as_same_data(
        zoo: store.DirStore) -> None:
    """The same files under another path: another spec fingerprint, the same content."""
    child = _job(*DEEPER)
    content = "content:sha256:" + "ab" * 32

    def rewrite(record: records.ZooRecord, **changes: object) -> records.ZooRecord:
        weights, parent_graph = records.load_weights(zoo, record), records.load_graph(zoo, record)
        records.delete_record(zoo, record.id)
        return records.write_record(zoo, dataclasses.replace(record, **changes), weights,
                                    parent_graph)

    _register(zoo, _job(*SMALL), accuracy=0.99, seed=1)  # better, data unknown
    weak, _ = _register(zoo, _job(*SMALL), accuracy=0.80, seed=2)  # this job's spec
    rewrite(weak, dataset_fingerprint=records.dataset_fingerprint(child.spec.dataset),
            content_fingerprint=content)
    moved, _ = _register(zoo, _job(*SMALL), accuracy=0.90, seed=3)  # the files elsewhere
    moved = rewrite(moved, dataset_fingerprint="spec-" + "cd" * 8, content_fingerprint=content)
    decided = decision.decide(child, zoo)
    assert decided.parent == moved.id  # the better of the two trained on this data
    assert "the same content, content:sha256:abababababab…" in decided.reason
    assert "2 of 3 were" in decided.reason


def test_a_preferred_id_never_reaches_another_namespaces_private_model(
        zoo: store.DirStore) -> None:
    """spec.warmStart.preferred ranks the models the job may see; it opens no other."""
    theirs, _ = _register(zoo, _job(*DEEPER), accuracy=0.99, seed=1)  # the closest match
    theirs = _owned(zoo, theirs, "team-a", api.ZooShare.PRIVATE)
    ours, _ = _register(zoo, _job(*SMALL), accuracy=0.80, seed=2)
    ours = _owned(zoo, ours, "team-b", api.ZooShare.PRIVATE)
    child = _in(_job(*DEEPER, preferred=[theirs.id, ours.id]), "team-b")
    decided = decision.decide(child, zoo)
    assert decided.parent == ours.id
    assert theirs.id not in decided.reason and theirs.id not in decided.alternatives
    # In team-a, the same list: its own model is visible, the best match and preferred first.
    assert decision.decide(_in(child, "team-a"), zoo).parent == theirs.id


def test_a_preferred_visible_model_near_the_best_match_is_chosen(zoo: store.DirStore) -> None:
    best, _ = _register(zoo, _job(*SMALL), accuracy=0.99, seed=1)
    sibling, _ = _register(zoo, _job(*SMALL), accuracy=0.50, seed=2)  # as similar, worse
    assert decision.decide(_job(*DEEPER), zoo).parent == best.id
    decided = decision.decide(_job(*DEEPER, preferred=[sibling.id]), zoo)
    assert decided.parent == sibling.id
    assert "listed in spec.warmStart.preferred" in decided.reason


def test_a_job_never_warm_starts_from_its_own_reserved_record(zoo: store.DirStore) -> None:
    # A trial resumed without its checkpoint once found its own final record, the most
    # similar model there is, and named itself its parent.
    uid = "0bf71648-aaaa-bbbb-cccc-000000000001"
    job = _job(*SMALL).model_copy(update={"metadata": _job(*SMALL).metadata.model_copy(
        update={"uid": uid})})
    other, _ = _register(zoo, _job(*DEEPER), accuracy=0.9)
    mine, _ = _register(zoo, _job(*SMALL), accuracy=0.95)
    reserved = records.job_record_id(job.spec.model.label, uid)
    weights, mine_graph = records.load_weights(zoo, mine), records.load_graph(zoo, mine)
    records.delete_record(zoo, mine.id)
    records.write_record(zoo, dataclasses.replace(mine, id=reserved), weights, mine_graph)
    decided = decision.decide(job, zoo)
    assert decided.parent == other.id and reserved not in decided.alternatives
    # another job (another uid) of the same spec may start from it
    assert decision.decide(_job(*SMALL), zoo).parent == reserved
