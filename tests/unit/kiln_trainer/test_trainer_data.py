"""kiln_trainer.data: the four dataset sources, the seeded split, augmentation and errors."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kiln import api
from kiln_trainer import data
from kiln_trainer.distributed import batching


def _spec(**fields: object) -> api.DatasetSpec:
    return api.DatasetSpec.model_validate(fields)


def _write_imagefolder(root: Path, *, classes: int = 3, per_class: int = 4) -> Path:
    rng = np.random.default_rng(0)
    for c in range(classes):
        folder = root / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, size=(12, 10, 3), dtype=np.uint8)
            Image.fromarray(pixels, mode="RGB").save(folder / f"{i}.png")
    return root


def _write_mnist(root: Path, *, count: int = 12) -> Path:
    """torchvision MNIST's raw idx files (big-endian magic, dims, then uint8 data)."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    images = np.random.default_rng(0).integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
    labels = (np.arange(count) % 10).astype(np.uint8)
    for split in ("train", "t10k"):
        (raw / f"{split}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 0x0803, count, 28, 28) + images.tobytes())
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(
            struct.pack(">II", 0x0801, count) + labels.tobytes())
    return root


def test_digits_are_resized_replicated_to_channels_and_standardised() -> None:
    splits = data.load(_spec(name="digits"), input_shape=[3, 12, 10], seed=0)
    image, label = splits.train[0]
    assert image.shape == (3, 12, 10)
    assert torch.equal(image[0], image[1]) and torch.equal(image[1], image[2])
    assert 0 <= int(label) < 10
    assert splits.num_classes == 10 and splits.modality == "image" and splits.in_memory
    assert len(splits.train) + len(splits.validation) == 1797
    train = torch.stack([splits.train[i][0] for i in range(len(splits.train))])
    assert abs(float(train.mean())) < 1e-3 and abs(float(train.std()) - 1.0) < 1e-2


def test_digits_at_native_size_are_the_bundled_pixels_standardised() -> None:
    from sklearn import datasets as sk_datasets

    spec = _spec(name="digits", validationFraction=0.5)
    splits = data.load(spec, input_shape=[1, 8, 8], seed=3)
    train_idx, val_idx = data.split_indices(1797, spec=spec, seed=3)
    pixels = torch.tensor(sk_datasets.load_digits().images, dtype=torch.float32) / 16.0
    mean, std = pixels[train_idx].mean(), pixels[train_idx].std()
    assert torch.allclose(splits.train[0][0][0], (pixels[train_idx[0]] - mean) / std, atol=1e-5)
    assert torch.allclose(splits.validation[0][0][0], (pixels[val_idx[0]] - mean) / std, atol=1e-5)


def test_digits_are_scikit_learns_arrays_with_their_fingerprint() -> None:
    from sklearn import datasets as sk_datasets

    from kiln_trainer import fingerprint

    bunch = sk_datasets.load_digits()
    pixels, labels = data.digits_arrays()
    assert (pixels.dtype, labels.dtype) == (bunch.images.dtype, bunch.target.dtype)
    assert np.array_equal(pixels, bunch.images) and np.array_equal(labels, bunch.target)
    # the zoo matches datasets by this value: it stays what scikit-learn's arrays give
    splits = data.load(_spec(name="digits"), input_shape=[1, 8, 8], seed=0)
    assert splits.fingerprint == fingerprint.of_arrays(bunch.images, bunch.target)


def test_split_is_deterministic_by_seed_and_disjoint() -> None:
    spec = _spec(name="digits", validationFraction=0.25)
    train_a, val_a = data.split_indices(1797, spec=spec, seed=7)
    train_b, val_b = data.split_indices(1797, spec=spec, seed=7)
    train_c, _ = data.split_indices(1797, spec=spec, seed=8)
    assert (train_a, val_a) == (train_b, val_b)
    assert train_a != train_c
    assert not set(train_a) & set(val_a)
    assert len(val_a) == round(1797 * 0.25) and len(train_a) + len(val_a) == 1797


def test_max_samples_caps_both_splits_together() -> None:
    splits = data.load(_spec(name="digits", maxSamples=100), input_shape=[1, 8, 8], seed=0)
    assert len(splits.train) == 80 and len(splits.validation) == 20


def test_flip_crop_augments_the_train_split_only() -> None:
    splits = data.load(_spec(name="digits", augmentation="flip-crop"), input_shape=[1, 16, 16],
                       seed=0)
    torch.manual_seed(0)
    views = {splits.train[0][0].numpy().tobytes() for _ in range(8)}
    assert len(views) > 1
    assert splits.validation[0][0].numpy().tobytes() == splits.validation[0][0].numpy().tobytes()
    assert splits.train[0][0].shape == (1, 16, 16)


def test_train_batches_repeat_for_the_same_epoch_and_skip_on_resume() -> None:
    splits = data.load(_spec(name="digits"), input_shape=[1, 8, 8], seed=0)
    first = [y for _, y in batching.train_batches(splits.train, batch_size=100, seed=0, epoch=2)]
    again = [y for _, y in batching.train_batches(splits.train, batch_size=100, seed=0, epoch=2)]
    later = [y for _, y in batching.train_batches(splits.train, batch_size=100, seed=0, epoch=2,
                                             start_batch=3)]
    other = [y for _, y in batching.train_batches(splits.train, batch_size=100, seed=0, epoch=3)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(first[3:], later, strict=True))
    assert not torch.equal(first[0], other[0])
    assert len(first) == batching.steps_per_epoch(splits.train, batch_size=100)


def test_a_trailing_batch_of_one_sample_is_dropped() -> None:
    dataset = torch.utils.data.TensorDataset(torch.zeros(9, 2), torch.zeros(9))
    sizes = [len(x) for x, _ in batching.train_batches(dataset, batch_size=4, seed=0, epoch=0)]
    assert sizes == [4, 4]
    assert batching.steps_per_epoch(dataset, batch_size=4) == 2


def test_text_windows_predict_the_next_byte(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(range(32, 127)) * 11)  # printable ASCII: 95 byte values, cycling
    splits = data.load(_spec(name="text", path=str(text)), input_shape=[15], seed=0)
    assert len(splits.train) + len(splits.validation) == 95 * 11 // 16
    inputs, targets = splits.train[0]
    assert inputs.shape == targets.shape == (15,)
    assert inputs.dtype == torch.long
    assert torch.equal(targets[:-1], inputs[1:])
    assert torch.equal(targets, (inputs - 32 + 1) % 95 + 32)
    assert splits.modality == "text" and splits.num_classes is None


def test_text_too_short_for_two_windows_names_the_path_and_fix(tmp_path: Path) -> None:
    text = tmp_path / "short.txt"
    text.write_text("hello", encoding="utf-8")
    with pytest.raises(data.DatasetError, match=r"short\.txt has 5 bytes.*shorter"):
        data.load(_spec(name="text", path=str(text)), input_shape=[64], seed=0)


def test_missing_text_path_is_a_dataset_error(tmp_path: Path) -> None:
    with pytest.raises(data.DatasetError, match="spec.dataset.path: .*nope.txt does not exist"):
        data.load(_spec(name="text", path=str(tmp_path / "nope.txt")), input_shape=[8], seed=0)


def test_a_text_directory_joins_its_utf8_files_in_path_order(tmp_path: Path) -> None:
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "b.py").write_text("bbbb", encoding="utf-8")
    (tmp_path / "src" / "pkg" / "a.txt").write_text("aaaa", encoding="utf-8")
    (tmp_path / "src" / "image.bin").write_bytes(bytes([0xFF, 0xFE, 0x00]))
    (tmp_path / "src" / ".hidden").write_text("hidden", encoding="utf-8")
    assert data.read_text_bytes(tmp_path / "src") == b"bbbb\naaaa"
    (tmp_path / "empty").mkdir()
    with pytest.raises(data.DatasetError, match="holds no UTF-8 text files"):
        data.read_text_bytes(tmp_path / "empty")


def test_imagefolder_is_resized_and_converted_to_grayscale(tmp_path: Path) -> None:
    root = _write_imagefolder(tmp_path / "pets")
    splits = data.load(_spec(name="imagefolder", path=str(root), validationFraction=0.25),
                       input_shape=[1, 8, 8], seed=0)
    image, label = splits.train[0]
    assert image.shape == (1, 8, 8) and image.dtype == torch.float32
    assert -1.0 <= float(image.min()) and float(image.max()) <= 1.0
    assert splits.num_classes == 3 and 0 <= label < 3
    assert len(splits.train) == 9 and len(splits.validation) == 3
    assert not splits.in_memory


def test_imagefolder_rgb_input_keeps_three_channels(tmp_path: Path) -> None:
    root = _write_imagefolder(tmp_path / "pets", classes=2, per_class=2)
    splits = data.load(_spec(name="imagefolder", path=str(root)), input_shape=[3, 16, 16], seed=0)
    assert splits.validation[0][0].shape == (3, 16, 16)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        pytest.param(lambda p: p / "absent", "is not a directory", id="missing"),
        pytest.param(lambda p: p, "holds no class folders", id="empty"),
    ],
)
def test_unusable_imagefolder_names_the_path_and_fix(tmp_path: Path, make: object,
                                                     match: str) -> None:
    path = make(tmp_path)  # type: ignore[operator]
    with pytest.raises(data.DatasetError, match=f"spec.dataset.path: .*{match}"):
        data.load(_spec(name="imagefolder", path=str(path)), input_shape=[3, 8, 8], seed=0)


def test_torchvision_mnist_loads_from_its_raw_files(tmp_path: Path) -> None:
    root = _write_mnist(tmp_path / "mnist")
    spec = _spec(name="torchvision", path=str(root), torchvisionClass="MNIST")
    splits = data.load(spec, input_shape=[1, 14, 14], seed=0)
    image, label = splits.train[0]
    assert image.shape == (1, 14, 14)
    assert splits.num_classes == 10 and 0 <= label < 10
    assert len(splits.train) + len(splits.validation) == 12
    assert splits.description == "torchvision:MNIST"


@pytest.mark.parametrize("name", ["MNIST", "CIFAR10"])
def test_torchvision_without_data_and_download_off_names_class_and_path(
    tmp_path: Path, name: str
) -> None:
    spec = _spec(name="torchvision", path=str(tmp_path), torchvisionClass=name)
    with pytest.raises(data.DatasetError, match=rf"{name} could not load .*{tmp_path}.*download"):
        data.load(spec, input_shape=[3, 32, 32], seed=0)


def test_torchvision_missing_root_is_a_dataset_error(tmp_path: Path) -> None:
    spec = _spec(name="torchvision", path=str(tmp_path / "nowhere"), torchvisionClass="MNIST")
    with pytest.raises(data.DatasetError, match="nowhere does not exist.*download: true"):
        data.load(spec, input_shape=[1, 28, 28], seed=0)


def test_unknown_torchvision_class_suggests_close_names(tmp_path: Path) -> None:
    spec = _spec(name="torchvision", path=str(tmp_path), torchvisionClass="CIFAR11")
    with pytest.raises(data.DatasetError, match="torchvisionClass: 'CIFAR11'.*CIFAR10"):
        data.load(spec, input_shape=[3, 32, 32], seed=0)


def test_fewer_than_two_samples_cannot_be_split(tmp_path: Path) -> None:
    root = _write_imagefolder(tmp_path / "one", classes=1, per_class=1)
    with pytest.raises(data.DatasetError, match="at least 2"):
        data.load(_spec(name="imagefolder", path=str(root)), input_shape=[3, 16, 16], seed=0)


def test_max_samples_below_two_splits_of_ten_is_refused_in_the_spec() -> None:
    with pytest.raises(ValueError, match="maxSamples"):
        api.parse_job({"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
                       "metadata": {"name": "few"},
                       "spec": {"model": {"architecture": "small_cnn"},
                                "dataset": {"maxSamples": 3}}})


def test_a_corrupt_image_in_an_imagefolder_names_the_file_and_the_fix(tmp_path: Path) -> None:
    root = _write_imagefolder(tmp_path / "pets", classes=2, per_class=2)
    bad = root / "class0" / "bad.png"
    bad.write_bytes(b"this is not a png")
    splits = data.load(_spec(name="imagefolder", path=str(root), validationFraction=0.5),
                       input_shape=[1, 8, 8], seed=0)
    with pytest.raises(data.DatasetError, match=rf"cannot read image {bad} .*remove or fix"):
        for split in (splits.train, splits.validation):
            for i in range(len(split)):  # type: ignore[arg-type]
                split[i]


def test_torchvision_classes_are_exactly_the_ones_the_api_accepts_and_their_signatures_fit(
) -> None:
    import inspect

    import torchvision

    assert tuple(data.TORCHVISION_CLASSES) == api.TORCHVISION_CLASSES
    for name, (split_kwargs, num_classes) in data.TORCHVISION_CLASSES.items():
        cls = getattr(torchvision.datasets, name)
        inspect.signature(cls).bind(root="/data", download=False, **split_kwargs)
        assert num_classes == len(getattr(cls, "classes", None) or range(num_classes)), name


@pytest.mark.parametrize("name", ["FakeData", "DatasetFolder", "VisionDataset"])
def test_torchvision_classes_outside_the_supported_list_are_a_dataset_error(
    tmp_path: Path, name: str
) -> None:
    spec = _spec(name="torchvision", path=str(tmp_path), torchvisionClass=name)
    with pytest.raises(data.DatasetError, match=f"'{name}' is not a supported .*CIFAR10"):
        data.load(spec, input_shape=[3, 32, 32], seed=0)


def test_a_binary_file_as_text_dataset_is_a_dataset_error(tmp_path: Path) -> None:
    binary = tmp_path / "ls"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8)
    with pytest.raises(data.DatasetError, match=r"ls is not UTF-8 text"):
        data.load(_spec(name="text", path=str(binary)), input_shape=[16], seed=0)


@pytest.mark.parametrize("fraction", [0.001, 0.995], ids=["too-few-validation", "too-few-train"])
def test_a_validation_fraction_leaving_a_split_under_ten_samples_is_a_dataset_error(
    fraction: float,
) -> None:
    with pytest.raises(data.DatasetError, match=r"validationFraction: .* each split needs at "
                       "least 10"):
        data.load(_spec(name="digits", validationFraction=fraction), input_shape=[1, 8, 8],
                  seed=0)


def _image_files(split: torch.utils.data.Dataset[object]) -> list[str]:
    """The real paths of the files a `data.load` image split reads."""
    return [os.path.realpath(split.base.samples[i][0])  # type: ignore[attr-defined]
            for i in split.indices]  # type: ignore[attr-defined]


def test_a_symlink_loop_in_an_imagefolder_counts_each_image_once(tmp_path: Path) -> None:
    root = _write_imagefolder(tmp_path / "pets", classes=2, per_class=10)
    (root / "class0" / "again").symlink_to(root / "class0")  # a loop: class0/again/again/...
    (root / "class1" / "copy.png").symlink_to(root / "class1" / "0.png")
    splits = data.load(_spec(name="imagefolder", path=str(root), validationFraction=0.5),
                       input_shape=[1, 8, 8], seed=0)
    train, validation = _image_files(splits.train), _image_files(splits.validation)
    assert len(train) + len(validation) == 20
    assert len(set(train + validation)) == 20
    assert not set(train) & set(validation)


def test_a_validation_path_inside_the_training_folder_validates_its_files_only(
    tmp_path: Path,
) -> None:
    root = _write_imagefolder(tmp_path / "pets", classes=2, per_class=12)
    held_out = tmp_path / "held-out"
    for c in range(2):
        (held_out / f"class{c}").mkdir(parents=True)
        for i in range(3):  # links into the training folder: the same real files
            (held_out / f"class{c}" / f"{i}.png").symlink_to(root / f"class{c}" / f"{i}.png")
    splits = data.load(_spec(name="imagefolder", path=str(root), validationPath=str(held_out)),
                       input_shape=[1, 8, 8], seed=0)
    train, validation = _image_files(splits.train), _image_files(splits.validation)
    assert len(validation) == 6 and len(train) == 18
    assert not set(train) & set(validation)


def test_a_validation_path_equal_to_the_training_folder_is_a_dataset_error(
    tmp_path: Path,
) -> None:
    root = _write_imagefolder(tmp_path / "pets", classes=2, per_class=2)
    with pytest.raises(data.DatasetError, match=r"spec.dataset.path: every image .* is also in "
                       r"spec.dataset.validationPath.*separate folders"):
        data.load(_spec(name="imagefolder", path=str(root), validationPath=str(root)),
                  input_shape=[1, 8, 8], seed=0)


def test_a_text_folder_reads_each_file_once_through_links_and_loops(tmp_path: Path) -> None:
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "a.txt").write_text("aaaa", encoding="utf-8")
    (tmp_path / "src" / "pkg" / "b.txt").write_text("bbbb", encoding="utf-8")
    (tmp_path / "src" / "pkg" / "up").symlink_to(tmp_path / "src")  # a loop
    (tmp_path / "src" / "z.txt").symlink_to(tmp_path / "src" / "a.txt")
    assert data.read_text_bytes(tmp_path / "src") == b"aaaa\nbbbb"


def test_text_shared_with_the_validation_path_is_left_out_of_training(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.txt").write_bytes(b"t" * 160)
    (corpus / "val.txt").write_bytes(b"v" * 160)
    splits = data.load(_spec(name="text", path=str(corpus),
                             validationPath=str(corpus / "val.txt")), input_shape=[15], seed=0)
    assert len(splits.train) == 10 and len(splits.validation) == 10
    assert all(set(splits.train[i][0].tolist()) == {ord("t")} for i in range(10))
    with pytest.raises(data.DatasetError, match="is also spec.dataset.validationPath"):
        data.load(_spec(name="text", path=str(corpus / "val.txt"),
                        validationPath=str(corpus / "val.txt")), input_shape=[15], seed=0)


def test_a_missing_local_dataset_uri_is_named_as_the_field_the_user_set(tmp_path: Path) -> None:
    spec = api.DatasetSpec.model_validate({"name": "text", "uri": str(tmp_path / "nodata")})
    with pytest.raises(data.DatasetError, match=r"^spec\.dataset\.uri: .*nodata does not exist"):
        data.load(spec, input_shape=(16,), seed=0, environ={})
