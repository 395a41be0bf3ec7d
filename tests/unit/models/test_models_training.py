"""small_resnet, the demo's model, learns scikit-learn's digits (8x8, upscaled to 16x16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from kiln import models


@pytest.mark.training
def test_small_resnet_reaches_95_percent_on_digits_in_eight_epochs() -> None:
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(16, 16), mode="bilinear", align_corners=False)
    images = (images - images.mean()) / images.std()
    labels = torch.tensor(digits.target)
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(images), generator=generator)
    validation, train = order[:360], order[360:]

    torch.manual_seed(0)
    model = models.get_model("small_resnet", input_shape=(1, 16, 16))
    epochs, batch_size = 8, 64
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4
    )
    steps = epochs * -(-len(train) // batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=steps)
    for _ in range(epochs):
        model.train()
        shuffled = train[torch.randperm(len(train), generator=generator)]
        for start in range(0, len(shuffled), batch_size):
            batch = shuffled[start : start + batch_size]
            loss = F.cross_entropy(model(images[batch]), labels[batch])
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
            optimizer.step()
            schedule.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(images[validation]).argmax(1) == labels[validation]).float().mean()
    assert accuracy >= 0.95
