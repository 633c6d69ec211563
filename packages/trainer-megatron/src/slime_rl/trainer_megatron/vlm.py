"""Qwen2.5-VL and Qwen3-VL in the Megatron trainer: the language model is the Qwen2 (Qwen3) GPTModel (model.py) with
multimodal RoPE, and the first pipeline stage holds the vision tower (vision.py, vision_qwen3.py), whose embeddings
replace the image placeholder tokens' embeddings before the first layer. Qwen3-VL also adds its deepstack features
to the image tokens' hidden states after each of its first layers (one feature map a layer), and interleaves the
rotary dims' streams (t, h, w, t, h, w, ...; `InterleavedMRoPE`) where Qwen2.5-VL gives each stream a run.

mRoPE: every token has three positions (t, h, w); a text token's three are equal and count on from the previous
token, an image's merged tokens take (t, row, column) offset by the position where the image starts, and the text
after an image continues from that start + max(rows, columns). The rotary dims are split by ``mrope_section``
between the three streams (megatron-core's ``MultimodalRotaryEmbedding``; transformers' ``get_rope_index`` and
``apply_multimodal_rotary_pos_emb`` are the reference). Packed micro-batches restart the positions at each
sequence: the rotary tables are built per token (``[tokens, 1, 1, dim]``), which megatron's thd RoPE reads by the
sequences' offsets.

The multimodal inputs of a sample are ``ImageInputs``: the processor's ``pixel_values`` (``[patches, C*T*P*P]``)
and ``image_grid_thw`` (``[images, 3]``) of its images, in the order their placeholder runs appear in the tokens.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from torch import Tensor

from slime_rl.trainer_megatron.model import PolicyGPT
from slime_rl.trainer_megatron.settings import megatron_settings
from slime_rl.trainer_megatron.vision import VisionShape, build_tower, vision_shape

#: HF architecture -> the text-only architecture whose language model it carries (support.py's table has both).
VL_TEXT_ARCHITECTURES = {"Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
                         "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM"}


def hf_name(shape, name: str) -> str:
    """A text model's HF name (``model.X``, ``lm_head.X``) or the tower's (``visual.X``) as the VL checkpoint has it
    (`VisionShape.prefixes`)."""
    text, vision = shape.vision.prefixes
    if name.startswith("visual."):
        return vision + name.removeprefix("visual.")
    return text + name.removeprefix("model.") if name.startswith("model.") else name


def canonical_name(shape, name: str) -> str:
    """The inverse of `hf_name`."""
    text, vision = shape.vision.prefixes
    if name.startswith(vision):
        return "visual." + name.removeprefix(vision)
    return "model." + name.removeprefix(text) if name.startswith(text) else name


@dataclass
class ImageInputs:
    """The images of one sample, or of a micro-batch's samples concatenated in row order."""

    pixel_values: Tensor  # [patches, channels * temporal_patch * patch * patch]
    grid_thw: Tensor  # [images, 3] int64: (frames, patch rows, patch columns) of each image

    @staticmethod
    def concat(parts: list[ImageInputs | None]) -> ImageInputs | None:
        parts = [p for p in parts if p is not None and len(p.grid_thw)]
        if not parts:
            return None
        return ImageInputs(torch.cat([p.pixel_values for p in parts]), torch.cat([p.grid_thw for p in parts]))

    def to(self, device: torch.device) -> ImageInputs:
        return ImageInputs(self.pixel_values.to(device), self.grid_thw)


def vl_model_shape(hf_config, text_shape):
    """The HFModelShape of a VL config: ``text_shape`` (model.hf_model_shape) of its text config, read as the
    text-only architecture it is, with the vision tower's shape and the top-level fields a VL config holds."""
    arch = next(a for a in hf_config.architectures if a in VL_TEXT_ARCHITECTURES)
    text = copy.copy(hf_config.text_config)
    text.architectures = [VL_TEXT_ARCHITECTURES[arch]]
    shape = text_shape(text)
    tie = bool(getattr(hf_config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))
    vision = vision_shape(hf_config)
    if sum(vision.mrope_section) * 2 != shape.head_dim:
        raise ValueError(f"model.path: mrope_section {list(vision.mrope_section)} covers {2 * sum(vision.mrope_section)}"
                         f" rotary dims; the heads have {shape.head_dim}")
    return dataclasses.replace(shape, family=vision.family, architecture=arch, tie_word_embeddings=tie, vision=vision)


# ---------------------------------------------------------------- positions


def mrope_positions(ids: Tensor, grid_thw: Tensor | None, v: VisionShape) -> Tensor:
    """``[3, len(ids)]`` (t, h, w) positions of one sequence whose image placeholder runs belong, in order, to the
    images of ``grid_thw`` (transformers' get_rope_index for images: a still image is one frame). Work per run of
    text or image tokens, not per token (thousands of tokens a sample, a few runs)."""
    ids = ids.long()
    n = len(ids)
    out = torch.empty(3, n, dtype=torch.long)
    image = ids == v.image_token_id
    bounds = [0, *((image[1:] != image[:-1]).nonzero().squeeze(1) + 1).tolist(), n]
    grids = grid_thw.tolist() if grid_thw is not None else []
    m = v.spatial_merge_size
    pos, k = 0, 0
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if a == b:
            continue
        if not image[a]:
            out[:, a:b] = torch.arange(pos, pos + b - a)
            pos += b - a
            continue
        while a < b:  # a run holds one image, or several placed back to back
            if k >= len(grids):
                raise ValueError(f"a sample has more image placeholder tokens than its {len(grids)} image(s) fill")
            t, h, w = grids[k]
            gh, gw = h // m, w // m
            count = t * gh * gw
            if a + count > b:
                raise ValueError(f"image {k} of a sample needs {count} placeholder tokens in a row; the sequence"
                                 f" has {b - a}")
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
            out[:, a:a + count] = torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]) + pos
            pos += max(gh, gw)
            a += count
            k += 1
    if k != len(grids):
        raise ValueError(f"a sample has {len(grids)} image(s) but placeholder tokens for {k}")
    return out


def micro_batch_positions(input_ids: Tensor, seq_lens: list[int] | None, images: list[ImageInputs | None],
                          v: VisionShape) -> Tensor:
    """The ``[3, b, s]`` positions of a micro-batch: padded rows (``seq_lens`` None; padding at 0) or one packed row
    of ``seq_lens`` sequences, each from 0. ``images``: each sequence's, in row order."""
    grids = [im.grid_thw if im is not None else None for im in images]
    if seq_lens is not None:  # sequence parallelism's padding sequence (sequence_parallel.pad_micro_batch) has none
        grids += [None] * (len(seq_lens) - len(grids))
    if seq_lens is None:
        out = torch.zeros(3, *input_ids.shape, dtype=torch.long)
        for row, grid in enumerate(grids):
            ids = input_ids[row].cpu()
            out[:, row] = mrope_positions(ids, grid, v)  # padding (id 0) counts on as text: never attended to
        return out
    ids = input_ids[0].cpu()
    parts, start = [], 0
    for length, grid in zip(seq_lens, grids, strict=True):
        parts.append(mrope_positions(ids[start:start + length], grid, v))
        start += length
    return torch.cat(parts, dim=1)[:, None]


# ---------------------------------------------------------------- the model


class PolicyVLM(PolicyGPT):
    """PolicyGPT with mRoPE and, on the first pipeline stage, the vision tower (``vision``)."""

    def __init__(self, *args, vision: VisionShape, **kwargs):
        super().__init__(*args, **kwargs)
        self.vision_shape = vision
        self.vision = None
        if self.pre_process:
            self.vision = build_tower(vision).to(self.config.params_dtype)
        if vision.mrope_interleaved:
            self.rotary_pos_emb = InterleavedMRoPE(self.rotary_pos_emb.inv_freq)

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask, *, images: ImageInputs | None = None,
                **kwargs):
        decoder_input, hooks = None, []
        if self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]
            if images is not None:
                embeds, deepstack = self.vision(images.pixel_values, images.grid_thw)
                rows = image_rows(input_ids, self.vision_shape.image_token_id, embeds.shape[0])
                flat = decoder_input.reshape(-1, decoder_input.shape[-1])
                rows, mine = self._local_rows(rows, flat.shape[0])
                decoder_input = flat.index_copy(0, rows, embeds[mine].to(flat.dtype)).view_as(decoder_input)
                # Qwen3-VL: feature map i joins the image tokens' hidden states after layer i (the first stage's)
                hooks = [self.decoder.layers[i].register_forward_hook(_DeepstackAdd(rows, feature[mine]))
                         for i, feature in enumerate(deepstack)]
        try:
            return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()

    def _local_rows(self, rows: Tensor, local: int) -> tuple[Tensor, Tensor]:
        """The image rows this rank's hidden states hold (of ``local`` rows) and which images' rows they are: all of
        them, or under sequence parallelism the TP rank's part of the ``[s, b]`` rows (its sequence chunk). The
        tower's gradients are then this rank's share, summed over TP by finalize_model_grads (``configure`` tags
        them ``sequence_parallel``)."""
        if not self.config.sequence_parallel:
            return rows, torch.arange(len(rows), device=rows.device)
        first = parallel_state.get_tensor_model_parallel_rank() * local
        mine = ((rows >= first) & (rows < first + local)).nonzero().squeeze(1)
        return rows[mine] - first, mine


def image_rows(input_ids: Tensor, image_token_id: int, count: int) -> Tensor:
    """The image placeholder tokens' rows in the ``[s, b]`` layout flattened, in sample order, then position order
    (how the micro-batch's images are concatenated); a ValueError unless there are ``count`` of them."""
    mask = input_ids == image_token_id  # [b, s]
    if int(mask.sum()) != count:
        raise ValueError(f"a micro-batch has {int(mask.sum())} image placeholder tokens and {count} image"
                         " embeddings; each sample's image_grid_thw must match its placeholder runs")
    b, s = mask.shape
    order = mask.reshape(-1).nonzero().squeeze(1)
    return (order % s) * b + order // s


class _DeepstackAdd:
    """A decoder layer's forward hook adding one deepstack feature map to the image tokens' outputs."""

    def __init__(self, rows: Tensor, feature: Tensor):
        self.rows, self.feature = rows, feature

    def __call__(self, module, args, output):
        hidden, *rest = output
        flat = hidden.reshape(-1, hidden.shape[-1]).index_add(0, self.rows, self.feature.to(hidden.dtype))
        return (flat.view_as(hidden), *rest)


class InterleavedMRoPE(torch.nn.Module):
    """Qwen3-VL's mRoPE table (transformers' Qwen3VLTextRotaryEmbedding): frequency i turns with the h position where
    i % 3 == 1 and i < 3 * sections[1], with w where i % 3 == 2 and i < 3 * sections[2], with t elsewhere. Called as
    megatron-core's MultimodalRotaryEmbedding is: ``[3, b, s]`` positions -> ``[s, b, 1, dim]``."""

    def __init__(self, inv_freq: Tensor):
        super().__init__()
        self.inv_freq = inv_freq

    def forward(self, position_ids: Tensor, mrope_section: list[int], cp_group=None) -> Tensor:
        freqs = position_ids.to(self.inv_freq.device).float()[..., None] * self.inv_freq.float()  # [3, b, s, d/2]
        out = freqs[0].clone()
        for stream in (1, 2):
            at = slice(stream, mrope_section[stream] * 3, 3)
            out[..., at] = freqs[stream, ..., at]
        emb = torch.cat([out, out], dim=-1)
        return emb[..., None, :].transpose(0, 1).contiguous()


# ---------------------------------------------------------------- the trainer's hooks


def configure(model, shape, cfg) -> None:
    """A VL model's checks against the layout (before DDP wraps the trainable weights) and
    ``trainer.freeze_vision_tower``; nothing for a text model."""
    if shape.vision is None:
        return
    p = cfg.parallel
    first_stage_layers = shape.num_layers // p.pipeline_model_parallel_size
    deepstack = len(shape.vision.deepstack_visual_indexes)
    recompute = megatron_settings(cfg).recompute
    unsupported = {"parallel.context_parallel_size > 1": p.context_parallel_size > 1,
                   "trainer.lora": cfg.trainer.lora.rank > 0,
                   # deepstack's additions are hooks on the first layers' forward, which a recomputed forward
                   # would run without, and whose features come from the first stage's vision tower
                   "trainer.megatron.recompute: true (full)": deepstack and recompute is True,
                   f"a first pipeline stage of fewer than the {deepstack} deepstack layers": first_stage_layers < deepstack}
    for name, on in unsupported.items():
        if on:
            raise ValueError(f"{name}: not supported with a vision-language model ({shape.architecture}) yet")
    if model.vision is not None:
        model.vision.recompute = recompute is True  # full recompute: the tower's blocks too
        for param in model.vision.parameters():  # SP: each TP rank's gradient covers its sequence chunk's images
            param.sequence_parallel = model.config.sequence_parallel
        if cfg.trainer.freeze_vision_tower:
            model.vision.requires_grad_(False)


def with_vision_inputs(mbs: list, batch, shape, device: torch.device) -> list:
    """``mbs`` with each micro-batch's mRoPE positions and images (the batch's ``images`` of its rows, in row order)."""
    if shape.vision is None:
        if batch.images is not None and any(x is not None for x in batch.images):
            raise ValueError(f"the batch's samples carry images and model.path is a text-only model"
                             f" ({shape.architecture}); train a vision-language model or drop data.image_key")
        return mbs
    per_sample = [None] * len(batch) if batch.images is None else [
        None if x is None else ImageInputs(torch.as_tensor(x["pixel_values"]), torch.as_tensor(x["image_grid_thw"]).long())
        for x in batch.images]
    for mb in mbs:
        images = [per_sample[r] for r in mb.rows.tolist()]
        seq_lens = list(mb.packed.seq_lens) if mb.packed is not None else None
        mb.position_ids = micro_batch_positions(mb.input_ids, seq_lens, images, shape.vision).to(device)
        merged = ImageInputs.concat(images)
        mb.model_inputs = {"images": merged.to(device) if merged is not None else None}
    return mbs
