"""What differs between the vision-language families served here, read from the upstream model
and its config; everything else (the pool, the cache, the walks) is shared.

    family     vision tower (upstream call)              image tokens       rotary positions
    qwen2-vl   model.get_image_features(pixel_values,    t*h*w / merge^2    M-RoPE: upstream
    qwen2.5-vl   image_grid_thw)                         per image          get_rope_index
    llava      model.get_image_features(pixel_values,    (H/p)*(W/p) per    1-D (the LM's own)
                 vision_feature_layer, select_strategy)  image (CLS dropped)

The walks' image inputs are the same for every family: ``pixel_values`` as the family's image
processor makes them (Qwen: [patches, C*T*p*p]; LLaVA: [images, 3, H, W]) and
``image_grid_thw`` [images, 3] int64: Qwen's patch grid as its processor gives it, for LLaVA
``(1, H/p, W/p)`` (what the API makes; it says how many images ``pixel_values`` holds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["MODEL_TYPES", "Family", "family_from_config", "family_of"]

#: ``config.json`` model types served as vision-language models -> family name
MODEL_TYPES = {"qwen2_vl": "qwen2-vl", "qwen2_5_vl": "qwen2.5-vl", "llava": "llava"}


@dataclass(frozen=True)
class Family:
    """One family's facts about a loaded model (see the module docstring)."""

    name: str
    image_token: int
    mrope: bool  # positions [3, N] from get_rope_index, else [N]
    vision_start: int | None = None  # tokens the chat template puts around an image
    vision_end: int | None = None
    patch: int = 1  # pixels per patch side (LLaVA's grid)
    merge: int = 1  # patches per image token side (Qwen)
    extra: int = 0  # tokens per image beyond its patches (LLaVA's CLS with the "full" strategy)

    # ------------------------------------------------------------------ images

    def tower(self, model: Any) -> Any:
        """The upstream vision tower module (its attention stays its own, not paged)."""
        return model.model.visual if self.mrope else model.model.vision_tower

    def split(self, pixel_values: Tensor, grid: Tensor) -> list[Tensor]:
        """``pixel_values`` -> one tensor per image (a row of ``grid`` each)."""
        if grid.dim() != 2 or grid.shape[1] != 3:
            raise ValueError(f"image_grid_thw must be [images, 3], got {tuple(grid.shape)}")
        if self.mrope:
            sizes = grid.prod(-1).tolist()
            if sum(sizes) != pixel_values.shape[0]:
                raise ValueError(
                    f"pixel_values holds {pixel_values.shape[0]} patches but image_grid_thw "
                    f"says {sum(sizes)}"
                )
            return list(torch.split(pixel_values, sizes))
        if pixel_values.dim() != 4 or pixel_values.shape[0] != grid.shape[0]:
            raise ValueError(
                f"pixel_values must be [images, 3, H, W] with one image per image_grid_thw row"
                f" ({grid.shape[0]}), got {tuple(pixel_values.shape)}"
            )
        return list(pixel_values.split(1))

    def tokens(self, grid_row: Tensor) -> int:
        """Image tokens of one image (its ``image_grid_thw`` row)."""
        return int(grid_row.prod()) // (self.merge * self.merge) + self.extra

    def encode(self, model: Any, images: list[Tensor], grids: list[Tensor]) -> list[Tensor]:
        """The features [tokens, D] of each image, by upstream's own call."""
        inner = model.model
        if self.mrope:
            out = inner.get_image_features(
                torch.cat(images), torch.stack(grids), return_dict=True
            ).pooler_output
        else:
            config = model.config
            out = inner.get_image_features(
                pixel_values=torch.cat(images),
                vision_feature_layer=config.vision_feature_layer,
                vision_feature_select_strategy=config.vision_feature_select_strategy,
                return_dict=True,
            ).pooler_output
        return [f.reshape(-1, f.shape[-1]) for f in out]

    def sample_image(self, model: Any) -> tuple[Tensor, Tensor]:
        """A small image's ``pixel_values`` and ``image_grid_thw`` for capture."""
        vision = model.config.vision_config
        if self.mrope:
            per_patch = 3 * int(vision.temporal_patch_size) * self.patch * self.patch
            grid = torch.tensor([[1, self.merge, self.merge]])
            return torch.zeros(int(grid.prod()), per_patch), grid
        size = int(vision.image_size)
        side = size // self.patch
        return torch.zeros(1, 3, size, size), torch.tensor([[1, side, side]])

    # ------------------------------------------------------------------ positions

    def rope(self, model: Any, ids: Tensor, grid: Tensor) -> tuple[Tensor, int]:
        """A prompt's M-RoPE positions [3, P] and its decode offset (position of token t >= P
        is ``t + delta`` in every row), as upstream ``generate()`` computes them."""
        ids = ids.reshape(1, -1)
        types = (ids == self.image_token).to(torch.int32)
        positions, delta = model.model.get_rope_index(ids, types, image_grid_thw=grid)
        return positions[:, 0], int(delta.reshape(-1)[0])


def family_of(model: Any) -> Family:
    """The family of a loaded upstream model (by its config's ``model_type``)."""
    return family_from_config(model.config)


def family_from_config(config: Any) -> Family:
    """The family of an upstream VLM config (``ValueError`` for another model type)."""
    kind = MODEL_TYPES.get(str(config.model_type))
    if kind is None:
        raise ValueError(
            f"{type(config).__name__}: model_type {config.model_type!r} is not a served "
            f"vision-language family ({', '.join(MODEL_TYPES)})"
        )
    if kind == "llava":
        return Family(
            kind,
            int(config.image_token_id),
            mrope=False,
            patch=int(config.vision_config.patch_size),
            extra=int(config.vision_feature_select_strategy == "full"),
        )
    vision = config.vision_config
    return Family(
        kind,
        int(config.image_token_id),
        mrope=True,
        vision_start=int(config.vision_start_token_id),
        vision_end=int(config.vision_end_token_id),
        patch=int(vision.patch_size),
        merge=int(vision.spatial_merge_size),
    )
