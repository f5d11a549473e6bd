"""Tiny random vision-language models (LLaVA with a CLIP tower, Qwen2-VL, Idefics3, Mistral 3, Gemma 3) saved with
the tiny tokenizer, its image tokens added, an image processor config and a chat template that renders image parts;
and the transformers reference (greedy `generate`) that batchgen's outputs must match."""

from __future__ import annotations

import copy

import numpy as np
import torch
from conftest import _tiny_tokenizer, save_random_model
from PIL import Image

TEXT = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6)
QWEN_SPECIALS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]


def clip_config():
    """LLaVA's and LLaVA-NeXT's tower: 2 CLIP layers on 32x32 crops of 8x8 patches (16 tokens a crop)."""
    import transformers as tf

    return tf.CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                               image_size=32, patch_size=8, projection_dim=64)


def chat_template(placeholder: str) -> str:
    return ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}" + placeholder +
            "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_llava(path, seed: int = 0, decoder: str = "llama"):
    """LLaVA: a 2-layer CLIP tower on 32x32 crops of 8x8 patches (16 image tokens an image), a Llama decoder
    (`decoder="olmo2"`: an OLMo 2 one, which batchgen runs through the transformers backend)."""
    import transformers as tf
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    tok = _tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = chat_template("<image>")
    vision = clip_config()
    text_class = tf.Olmo2Config if decoder == "olmo2" else tf.LlamaConfig
    text = text_class(vocab_size=len(tok), head_dim=64, **TEXT, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>"),
                            vision_feature_layer=-2)
    save_random_model(path, tf.LlavaForConditionalGeneration, config, tok, seed)
    LlavaImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(path)
    return path


def build_qwen2_vl(path, seed: int = 0, version: str = "2"):
    """Qwen2-VL (Qwen2.5-VL with `version="2.5"`): a 2-block vision transformer on 14x14 patches merged 2x2 (4 to
    16 tokens an image; Qwen2.5-VL's in windows of 2x2 tokens), a Qwen2 decoder with M-RoPE sections [16, 8, 8];
    Qwen2.5-VL's head tied to its embeddings by the top-level config, as the small Qwen2-VL/2.5-VL checkpoints'."""
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = _tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS})
    tok.chat_template = chat_template("<|vision_start|><|image_pad|><|vision_end|>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    text = dict(TEXT, vocab_size=len(tok), rope_parameters={"rope_type": "default", "mrope_section": [16, 8, 8],
                                                            "rope_theta": 10000.0},
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(depth=2, embed_dim=64, hidden_size=256, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    config_class, model_class = tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration
    if version == "2.5":
        vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=256, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
        config_class, model_class = tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration
    config = config_class(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"], bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, tie_word_embeddings=version == "2.5")
    save_random_model(path, model_class, config, tok, seed)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 16).save_pretrained(path)
    return path


def build_idefics3(path, seed: int = 0, family: str = "idefics3"):
    """Idefics3 (SmolVLM's architecture): a 2-layer vision transformer on 32x32 tiles of 8x8 patches, pixel-shuffled
    by 2 into 4 tokens a tile; images up to 64 pixels a side split into up to 2x2 tiles and a global view; a Llama
    decoder."""
    import transformers as tf
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tok = _tiny_tokenizer()
    tags = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    tok.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>", "<global-img>",
                                                          "<end_of_utterance>", *tags]})
    tok.chat_template = chat_template("<image>")
    text = tf.LlamaConfig(vocab_size=len(tok), head_dim=64, **TEXT, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8)
    smol = family == "smolvlm"  # SmolVLM2's own classes: the same model and image splitting
    config_class = tf.SmolVLMConfig if smol else tf.Idefics3Config
    config = config_class(vision_config=vision, text_config=text.to_dict(), scale_factor=2,
                          image_token_id=tok.convert_tokens_to_ids("<image>"), pad_token_id=tok.pad_token_id)
    save_random_model(path, tf.SmolVLMForConditionalGeneration if smol else tf.Idefics3ForConditionalGeneration,
                      config, tok, seed)
    if smol:
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil as processor
    else:
        processor = Idefics3ImageProcessorPil
    processor(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}).save_pretrained(path)
    return path


def build_mistral3(path, seed: int = 0):
    """Mistral 3: a 2-layer Pixtral vision model of 8x8 patches (images up to 64 pixels a side, at their aspect),
    merged 2x2 into one token, each row of tokens ending in [IMG_BREAK], the last in [IMG_END]; a Mistral decoder."""
    import transformers as tf
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    tok = _tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]})
    tok.chat_template = chat_template("[IMG]")
    text = tf.MistralConfig(vocab_size=len(tok), head_dim=64, **TEXT, sliding_window=None,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = tf.PixtralVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                    head_dim=32, image_size=64, patch_size=8)
    config = tf.Mistral3Config(vision_config=vision, text_config=text, spatial_merge_size=2,
                               image_token_id=tok.convert_tokens_to_ids("[IMG]"), vision_feature_layer=-1)
    save_random_model(path, tf.Mistral3ForConditionalGeneration, config, tok, seed)
    PixtralImageProcessorPil(size={"longest_edge": 64}, patch_size={"height": 16, "width": 16}).save_pretrained(path)
    return path


GEMMA3_SPECIALS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]


def build_gemma3(path, seed: int = 0):
    """Gemma 3: a 2-layer SigLIP tower on 32x32 images of 8x8 patches, average-pooled 2x2 into 4 image tokens
    (`mm_tokens_per_image`), each image `\n\n<start_of_image>` + its tokens + `<end_of_image>\n\n`; a Gemma 3
    decoder of a sliding layer (a window of 3, shorter than an image's run) and a global one."""
    import transformers as tf
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = _tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": GEMMA3_SPECIALS})
    tok.chat_template = chat_template("<start_of_image>")
    boi, image_id, eoi = tok.convert_tokens_to_ids(GEMMA3_SPECIALS)
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    text = tf.Gemma3TextConfig(vocab_size=len(tok), head_dim=64, **TEXT, hidden_activation="gelu_pytorch_tanh",
                               query_pre_attn_scalar=64, sliding_window=3,
                               layer_types=["sliding_attention", "full_attention"], rope_parameters=rope,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)
    vision = tf.SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=32, patch_size=8)
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=boi,
                             eoi_token_index=eoi, image_token_index=image_id, bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                             tie_word_embeddings=False)  # tied, the scaled embeddings make it repeat its input
    save_random_model(path, tf.Gemma3ForConditionalGeneration, config, tok, seed)
    Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(path)
    return path


GRID_PINPOINTS = [[32, 64], [64, 32], [64, 64]]


def build_llava_next(path, seed: int = 0):
    """LLaVA-NeXT (the generic path): LLaVA's CLIP tower and Llama decoder, an image as a 32x32 base crop and up to
    2x2 crops of its best-fitting grid, unpadded, each row of crop tokens ending in the image newline (`<image>`
    tokens all); its own processor saved beside it."""
    import transformers as tf
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tok = _tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = chat_template("<image>")
    text = tf.LlamaConfig(vocab_size=len(tok), head_dim=64, **TEXT, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = tf.LlavaNextConfig(vision_config=clip_config(), text_config=text, vision_feature_layer=-2,
                                image_token_id=tok.convert_tokens_to_ids("<image>"),
                                image_grid_pinpoints=GRID_PINPOINTS)
    save_random_model(path, tf.LlavaNextForConditionalGeneration, config, tok, seed)
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                        image_grid_pinpoints=GRID_PINPOINTS)
    tf.LlavaNextProcessor(image_processor=images, tokenizer=tok, patch_size=8, vision_feature_select_strategy="default",
                          num_additional_image_tokens=1).save_pretrained(path)
    return path


AYA_SPECIALS = ["<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>", "TILE",
                "TILE_GLOBAL"]


def build_aya_vision(path, seed: int = 0):
    """Aya Vision (the generic path): a 2-layer SigLIP tower on 32x32 tiles of 8x8 patches, pixel-shuffled by 2 into
    4 tokens a tile; an image split into up to 4 tiles and a global view, each tile's `<|IMG_PATCH|>` tokens after
    its tag (a run a tile); a Cohere 2 decoder (the transformers backend's); its own processor saved beside it."""
    import transformers as tf
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    tok = _tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": AYA_SPECIALS})
    tok.chat_template = chat_template("<image>")
    text = tf.Cohere2Config(vocab_size=len(tok), head_dim=64, **{k: v for k, v in TEXT.items() if k != "rms_norm_eps"},
                            sliding_window=4096, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)
    vision = tf.SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=32, patch_size=8)
    config = tf.AyaVisionConfig(vision_config=vision, text_config=text, downsample_factor=2,
                                image_token_id=tok.convert_tokens_to_ids("<|IMG_PATCH|>"))
    save_random_model(path, tf.AyaVisionForConditionalGeneration, config, tok, seed)
    images = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=True, max_patches=4)
    tf.AyaVisionProcessor(image_processor=images, tokenizer=tok, patch_size=8, img_size=32,
                          downsample_factor=2).save_pretrained(path)
    return path


def image(seed: int, size: tuple[int, int] = (40, 50)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8"))


def hf_greedy(model, encoded, max_new_tokens: int) -> list[int]:
    """transformers' greedy output for an `EncodedPrompt` (its expanded token ids and images), on the model's
    device."""
    ids = torch.tensor([encoded.token_ids])
    kwargs = {}
    if encoded.multi_modal is not None:
        kwargs = {key: value.to(model.device) for key, value in
                  reference_images(model, ids, encoded.multi_modal.images).items()}
    ids = ids.to(model.device)
    config = copy.deepcopy(model.generation_config)
    # as ignore_eos: an end-of-sequence token is generated and read on (min_new_tokens would suppress it instead)
    never = model.config.get_text_config().vocab_size  # an id no step can give: no end of sequence
    config.update(eos_token_id=never, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **kwargs)
    return out[0, ids.shape[1]:].tolist()


def reference_images(model, ids: torch.Tensor, images: list) -> dict:
    """transformers' image arguments of `generate` for a prompt's image inputs, in each family's layout."""
    if model.config.model_type == "mistral3":  # rows of whole images: the images, padded into one batch
        unique = list({id(i.pixel_values): i.pixel_values for i in images}.values())
        sizes = [list(p.shape[-2:]) for p in unique]
        height, width = max(h for h, _ in sizes), max(w for _, w in sizes)
        pad = torch.nn.functional.pad
        return {"pixel_values": torch.cat([pad(p, (0, width - p.shape[-1], 0, height - p.shape[-2])) for p in unique]),
                "image_sizes": torch.tensor(sizes)}
    if images[0].extras or model.config.model_type in ("llava_next", "aya_vision"):  # the generic path's
        return generic_reference_images(images)
    kwargs = {"pixel_values": torch.cat([i.pixel_values for i in images])}
    if images[0].pixel_mask is not None:  # Idefics3: the tiles as one sample's images
        kwargs["pixel_values"] = kwargs["pixel_values"][None]
        kwargs["pixel_attention_mask"] = torch.cat([i.pixel_mask for i in images])[None]
    if model.config.model_type == "gemma3":  # its image tokens see each other both ways
        kwargs["token_type_ids"] = (ids == model.config.image_token_id).int()
    if images[0].grid_thw is not None:
        kwargs["image_grid_thw"] = torch.tensor([i.grid_thw for i in images])
        kwargs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    return kwargs


def generic_reference_images(images: list) -> dict:
    """The processor's tensors of a prompt's images as one call of it gives them: LLaVA-NeXT's crops padded to the
    most any image has (its model reads each image's own count from image_sizes)."""
    unique = list({id(i.pixel_values): i for i in images}.values())
    pixels = [i.pixel_values for i in unique]
    if pixels[0].dim() == 5:
        most = max(p.shape[1] for p in pixels)
        pixels = [torch.nn.functional.pad(p, (0, 0, 0, 0, 0, 0, 0, most - p.shape[1])) for p in pixels]
    return {"pixel_values": torch.cat(pixels)} | {key: torch.cat([i.extras[key] for i in unique])
                                                  for key in unique[0].extras}
