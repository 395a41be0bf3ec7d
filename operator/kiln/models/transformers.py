"""Small transformers: `vit` (images by patches) and `char_transformer` (causal byte-level LM).

Small enough to train on CPU; no dropout, no KV cache, no pretrained weights. Shapes: B batch,
C channels, H height, W width, P patch size, N = (H/P)(W/P) patches, T sequence length,
D width (model dim), V vocabulary size, K classes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.models import registry

VIT_PAPER = (
    "Dosovitskiy et al., An Image is Worth 16x16 Words: Transformers for Image Recognition at "
    "Scale, ICLR 2021 (2010.11929); pre-norm: Xiong et al., ICML 2020 (2002.04745)"
)
CHAR_TRANSFORMER_PAPER = (
    "Vaswani et al., Attention Is All You Need, NeurIPS 2017 (1706.03762); character-level "
    "decoder: Al-Rfou et al., AAAI 2019 (1808.04444); pre-norm: Xiong et al., ICML 2020 "
    "(2002.04745)"
)


class SelfAttention(nn.Module):
    """Multi-head self-attention: Tensor[B, T, D] -> Tensor[B, T, D].

    Args:
        width: D, divisible by `heads`.
        heads: number of heads; each has D / heads channels.
        causal: mask attention to later positions.
    """

    def __init__(self, width: int, heads: int, *, causal: bool) -> None:
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)
        self.value = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tensor[B, T, D] -> Tensor[B, T, D]."""
        head_width = self.query.out_features // self.heads
        # [B, T, D] -> [B, heads, T, D/heads]; sizes come from attributes, so fx sees no shapes
        query = self.query(tokens).unflatten(-1, (self.heads, head_width)).transpose(1, 2)
        key = self.key(tokens).unflatten(-1, (self.heads, head_width)).transpose(1, 2)
        value = self.value(tokens).unflatten(-1, (self.heads, head_width)).transpose(1, 2)
        mixed = F.scaled_dot_product_attention(query, key, value, is_causal=self.causal)
        result: torch.Tensor = self.out(mixed.transpose(1, 2).flatten(2))
        return result


# Both families stack the same pre-norm block (Xiong et al. 2020): x + attention(LN(x)), then
# x + MLP(LN(x)). The blocks are written out (separate query/key/value/output projections)
# instead of using `nn.TransformerEncoderLayer`, so `torch.fx.symbolic_trace` sees every Linear
# and LayerNorm (torch.nn modules are fx leaves, and a leaf hides its weights from the
# warm-start graph matcher) and tracing works on `meta`.
class TransformerBlock(nn.Module):
    """Pre-norm transformer layer: Tensor[B, T, D] -> Tensor[B, T, D].

    Args:
        width: D.
        heads: attention heads.
        mlp_ratio: hidden width of the MLP as a multiple of D.
        causal: causal self-attention (language models).
    """

    def __init__(self, width: int, heads: int, *, mlp_ratio: float, causal: bool) -> None:
        super().__init__()
        hidden = max(1, round(width * mlp_ratio))
        self.norm1 = nn.LayerNorm(width)
        self.attention = SelfAttention(width, heads, causal=causal)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tensor[B, T, D] -> Tensor[B, T, D]."""
        tokens = tokens + self.attention(self.norm1(tokens))
        result: torch.Tensor = tokens + self.mlp(self.norm2(tokens))
        return result


# ----------------------------------------------------------------------------------------------
# vit


class PatchEmbedding(nn.Module):
    """ViT stem: Tensor[B, C, H, W] -> tokens Tensor[B, 1 + N, D] (class token first).

    Args:
        in_channels: C.
        num_patches: N.
        patch_size: P; the conv has kernel and stride P.
        width: D.
    """

    def __init__(self, in_channels: int, num_patches: int, patch_size: int, width: int) -> None:
        super().__init__()
        self.projection = nn.Conv2d(in_channels, width, patch_size, stride=patch_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, width))
        self.position = nn.Parameter(torch.zeros(1, 1 + num_patches, width))
        nn.init.trunc_normal_(self.class_token, std=0.02)
        nn.init.trunc_normal_(self.position, std=0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Tensor[B, C, H, W] -> Tensor[B, 1 + N, D]."""
        patches = self.projection(images).flatten(2).transpose(1, 2)  # [B, N, D]
        cls = self.class_token.expand(patches.shape[0], -1, -1)  # [B, 1, D]
        return torch.cat([cls, patches], dim=1) + self.position


class ClassTokenHead(nn.Module):
    """ViT head: LayerNorm, then a linear layer on the class token: Tensor[B, 1+N, D] -> [B, K]."""

    def __init__(self, width: int, num_classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tensor[B, 1 + N, D] -> logits Tensor[B, K]."""
        result: torch.Tensor = self.linear(self.norm(tokens[:, 0]))
        return result


class VisionTransformer(nn.Module):
    """ViT classifier: stem, `depth` transformer layers, class-token head.

    Args:
        in_channels: C.
        num_patches: N = (H / P) * (W / P).
        patch_size: P.
        depth: transformer layers.
        width: D.
        heads: attention heads.
        mlp_ratio: MLP hidden width / D.
        num_classes: K.
    """

    def __init__(
        self,
        *,
        in_channels: int,
        num_patches: int,
        patch_size: int,
        depth: int,
        width: int,
        heads: int,
        mlp_ratio: float,
        num_classes: int,
    ) -> None:
        super().__init__()
        self.stem = PatchEmbedding(in_channels, num_patches, patch_size, width)
        self.layers = nn.Sequential(
            *(
                TransformerBlock(width, heads, mlp_ratio=mlp_ratio, causal=False)
                for _ in range(depth)
            )
        )
        self.head = ClassTokenHead(width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Tensor[B, C, H, W] float -> logits Tensor[B, K]."""
        result: torch.Tensor = self.head(self.layers(self.stem(images)))
        return result


@registry.register_model(
    "vit",
    family="vit",
    modality=registry.Modality.IMAGE,
    task=registry.Task.CLASSIFICATION,
    paper=VIT_PAPER,
)
def vit(
    *,
    input_shape: tuple[int, ...],
    depth: int = 4,
    width: int = 64,
    heads: int = 4,
    patch_size: int = 4,
    mlp_ratio: float = 2.0,
    num_classes: int = 10,
) -> nn.Module:
    """Small Vision Transformer over P x P patches; Tensor[B, C, H, W] -> Tensor[B, K].

    Args:
        input_shape: (C, H, W) with H and W divisible by `patch_size`.
        depth: transformer layers, >= 1.
        width: model width D, >= 1, divisible by `heads`.
        heads: attention heads, >= 1.
        patch_size: P, >= 1.
        mlp_ratio: MLP hidden width / D, > 0.
        num_classes: K, >= 1.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range, or `width` is not divisible by `heads`.
        IncompatibleInputShape: `input_shape` is not (C, H, W), or H or W is not divisible by P.
    """
    channels, height, image_width = registry.image_shape(input_shape)
    patch_size = registry.require_int("patch_size", patch_size, minimum=1)
    if height % patch_size or image_width % patch_size:
        raise registry.IncompatibleInputShape(
            f"vit needs H and W divisible by patch_size {patch_size} (got {list(input_shape)}); "
            "change patchSize or the input size"
        )
    width, heads = _width_and_heads(width, heads)
    return VisionTransformer(
        in_channels=channels,
        num_patches=(height // patch_size) * (image_width // patch_size),
        patch_size=patch_size,
        depth=registry.require_int("depth", depth, minimum=1),
        width=width,
        heads=heads,
        mlp_ratio=registry.require_float("mlp_ratio", mlp_ratio, minimum_exclusive=0.0),
        num_classes=registry.require_int("num_classes", num_classes, minimum=1),
    )


@registry.declare_blocks(VisionTransformer)
def _vit_blocks(model: VisionTransformer) -> list[str]:
    return ["stem", *(f"layers.{i}" for i in range(len(model.layers))), "head"]


# ----------------------------------------------------------------------------------------------
# char_transformer


class TokenEmbedding(nn.Module):
    """LM stem: LongTensor[B, T] -> Tensor[B, T, D], byte embedding plus learned positions.

    Args:
        vocab_size: V.
        max_length: the longest T accepted (the job's input shape).
        width: D.
    """

    def __init__(self, vocab_size: int, max_length: int, width: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(max_length, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """LongTensor[B, T] with T <= max_length -> Tensor[B, T, D]."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        result: torch.Tensor = self.token(tokens) + self.position(positions)
        return result


class CharTransformer(nn.Module):
    """Causal character-level language model: stem, `depth` causal layers, LN + linear head.

    Position t only sees positions <= t. No weight tying, so the stem and head freeze
    separately.

    Args:
        vocab_size: V (256 for bytes).
        max_length: the longest sequence T.
        depth: transformer layers.
        width: D.
        heads: attention heads.
        mlp_ratio: MLP hidden width / D.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        max_length: int,
        depth: int,
        width: int,
        heads: int,
        mlp_ratio: float,
    ) -> None:
        super().__init__()
        self.stem = TokenEmbedding(vocab_size, max_length, width)
        self.layers = nn.Sequential(
            *(
                TransformerBlock(width, heads, mlp_ratio=mlp_ratio, causal=True)
                for _ in range(depth)
            )
        )
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, vocab_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """LongTensor[B, T] -> next-token logits Tensor[B, T, V] (position t predicts t + 1)."""
        result: torch.Tensor = self.head(self.layers(self.stem(tokens)))
        return result


@registry.register_model(
    "char_transformer",
    family="char_transformer",
    modality=registry.Modality.TEXT,
    task=registry.Task.LANGUAGE_MODELING,
    paper=CHAR_TRANSFORMER_PAPER,
)
def char_transformer(
    *,
    input_shape: tuple[int, ...],
    depth: int = 2,
    width: int = 64,
    heads: int = 4,
    vocab_size: int = 256,
    mlp_ratio: float = 4.0,
) -> nn.Module:
    """Small causal transformer LM over bytes; LongTensor[B, T] -> Tensor[B, T, V].

    Args:
        input_shape: (T,), the longest sequence the model accepts.
        depth: transformer layers, >= 1.
        width: model width D, >= 1, divisible by `heads`.
        heads: attention heads, >= 1.
        vocab_size: V, >= 1 (256: one token per byte).
        mlp_ratio: MLP hidden width / D, > 0.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range, or `width` is not divisible by `heads`.
        IncompatibleInputShape: `input_shape` is not (T,).
    """
    max_length = registry.sequence_length(input_shape)
    width, heads = _width_and_heads(width, heads)
    return CharTransformer(
        vocab_size=registry.require_int("vocab_size", vocab_size, minimum=1),
        max_length=max_length,
        depth=registry.require_int("depth", depth, minimum=1),
        width=width,
        heads=heads,
        mlp_ratio=registry.require_float("mlp_ratio", mlp_ratio, minimum_exclusive=0.0),
    )


@registry.declare_blocks(CharTransformer)
def _char_transformer_blocks(model: CharTransformer) -> list[str]:
    return ["stem", *(f"layers.{i}" for i in range(len(model.layers))), "head"]


def _width_and_heads(width_arg: object, heads_arg: object) -> tuple[int, int]:
    width = registry.require_int("width", width_arg, minimum=1)
    heads = registry.require_int("heads", heads_arg, minimum=1)
    if width % heads:
        raise ValueError(f"width {width} must be divisible by heads {heads}")
    return width, heads
