#!/usr/bin/env python
"""The caption workload (scripts/bench.py --workloads caption; issue 55): N images x 1 prompt through a
vision-language model, batchgen's `LLM.generate` against transformers' batched `generate` in the same run, on the
same preprocessed inputs, greedy with ignore_eos (so both make exactly max_tokens tokens an image).

Reported for each engine: images/s, output tokens/s, total tokens/s (prompt tokens, the image tokens included, plus
output), and the vision encoder's seconds and share of the run (the tower and projector: batchgen's engine
stat `vision_seconds`, transformers' tower and projector modules). batchgen's time includes the image processor's work
(its `encode_batch`), transformers' does not (its inputs are prepared before its clock starts); decoding the JPEG files
(`batchgen.images.load_image`, a job's reader thread) is timed on its own, before either.

The model: `--vision-model DIR` (a LLaVA or Qwen2-VL directory), else a random LLaVA built here: SmolLM2-135M's
decoder shape and tokenizer (with `<image>` added) under a CLIP tower of 224x224 crops in 14x14 patches (256 image
tokens an image; 6 layers of width 384), random weights: the throughput of the real shapes, not real captions.

    .venv/bin/python scripts/bench_caption.py --images 32 --max-tokens 32
    .venv/bin/python scripts/bench.py --workloads caption --quick
"""

from __future__ import annotations

import argparse
import io
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = "Describe this image in detail."  # no placeholder: the engine puts the image in front, for any model


@dataclass
class CaptionRun:
    engine: str
    images: int
    seconds: float
    prompt_tokens: int
    output_tokens: int
    vision_seconds: float

    def record(self) -> dict:
        return {**asdict(self), "images_s": self.images / self.seconds, "out_tok_s": self.output_tokens / self.seconds,
                "total_tok_s": (self.prompt_tokens + self.output_tokens) / self.seconds,
                "vision_share": self.vision_seconds / self.seconds}


def build_llava(path: Path, seed: int = 0) -> Path:
    """A random LLaVA of SmolLM2-135M's decoder shape under a small CLIP tower (see the module's docstring)."""
    import transformers as tf
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    from batchgen.models.smollm2 import ensure_smollm2

    text_dir = ensure_smollm2()
    tok = tf.AutoTokenizer.from_pretrained(text_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = tf.AutoConfig.from_pretrained(text_dir)
    text.vocab_size = len(tok)
    vision = tf.CLIPVisionConfig(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=6,
                                 image_size=224, patch_size=14, projection_dim=384)
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>"),
                            vision_feature_layer=-2)
    torch.manual_seed(seed)
    model = tf.LlavaForConditionalGeneration(config).float().eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    LlavaImageProcessorPil(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}).save_pretrained(path)
    return path


def photos(count: int, seed: int) -> list[bytes]:
    """JPEG files of camera-ish sizes (640x480 to 1024x768), smooth random colour fields."""
    from PIL import Image

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        w, h = rng.choice([(640, 480), (800, 600), (1024, 768)])
        small = Image.frombytes("RGB", (8, 6), bytes(rng.randrange(256) for _ in range(8 * 6 * 3)))
        buf = io.BytesIO()
        small.resize((w, h), Image.BILINEAR).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def hooked(module: torch.nn.Module, seconds: list[float]) -> None:
    """Forward hooks adding ``module``'s forward wall time to ``seconds[0]``."""
    started: list[float] = []
    module.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))
    module.register_forward_hook(lambda *_: seconds.__setitem__(0, seconds[0] + time.perf_counter() - started.pop()))


def run_batchgen(model: str, images: list, max_tokens: int, dtype: str, threads: int) -> CaptionRun:
    from batchgen import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, num_threads=threads, kv_cache_memory="2GiB", max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in images]
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up: first-call costs of the tower and the kernels
    vision = llm.stats()["vision_seconds"]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return CaptionRun("batchgen", len(images), seconds, sum(len(o.prompt_token_ids) for o in outs),
                      sum(len(o.outputs[0].token_ids) for o in outs), llm.stats()["vision_seconds"] - vision)


def run_transformers(model: str, encoded: list, max_tokens: int, dtype: str, batch_size: int) -> CaptionRun:
    """transformers' `generate` on static batches of ``batch_size`` of the prompts batchgen encoded (the same token
    ids, image tokens expanded, and pixel values), left-padded."""
    import transformers as tf

    hf = tf.AutoModelForImageTextToText.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    vision = [0.0]
    for name in ("vision_tower", "multi_modal_projector", "visual"):  # LLaVA's tower and projector; Qwen2-VL's
        if hasattr(hf.model, name):
            hooked(getattr(hf.model, name), vision)
    pad = hf.config.text_config.pad_token_id or 0

    def inputs(rows) -> dict:
        width = max(len(e.token_ids) for e in rows)
        ids = torch.tensor([[pad] * (width - len(e.token_ids)) + e.token_ids for e in rows])
        images = [i for e in rows for i in e.multi_modal.images]
        out = {"input_ids": ids, "pixel_values": torch.cat([i.pixel_values for i in images]).to(hf.dtype),
               "attention_mask": torch.tensor([[0] * (width - len(e.token_ids)) + [1] * len(e.token_ids)
                                               for e in rows])}
        if images[0].grid_thw is not None:  # Qwen2-VL
            out["image_grid_thw"] = torch.tensor([i.grid_thw for i in images])
            out["mm_token_type_ids"] = (ids == hf.config.image_token_id).int()
        return out

    def generate(rows):
        given = inputs(rows)
        with torch.no_grad():
            out = hf.generate(**given, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                              pad_token_id=pad)
        return out[:, given["input_ids"].shape[1]:]

    generate(encoded[:1])  # warm-up
    vision[0] = 0.0
    start = time.perf_counter()
    output = 0
    for i in range(0, len(encoded), batch_size):
        output += generate(encoded[i:i + batch_size]).numel()
    seconds = time.perf_counter() - start
    return CaptionRun(f"transformers-b{batch_size}", len(encoded), seconds, sum(len(e.token_ids) for e in encoded),
                      output, vision[0])


def caption_bench(vision_model: str | None, count: int, max_tokens: int, dtype: str, threads: int,
                  batch_size: int, seed: int = 0) -> dict:
    """Both engines on ``count`` images; the report as a dict (``print_caption`` prints it)."""
    from batchgen.images import load_image

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = vision_model or str(build_llava(Path(tmp) / "llava"))
        files = photos(count, seed)
        start = time.perf_counter()
        images = [load_image(f) for f in files]
        decode_s = time.perf_counter() - start
        ours = run_batchgen(model, images, max_tokens, dtype, threads)
        from batchgen import LLM

        encoded = LLM(model, dtype=dtype, kv_cache_memory="64MiB", max_model_len=1024).encode_batch(
            [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in images])
        peer = run_transformers(model, encoded, max_tokens, dtype, batch_size)
    runs = [ours.record(), peer.record()]
    return {"model": vision_model or "random LLaVA (SmolLM2-135M decoder, CLIP 224/14 x6)", "images": count,
            "max_tokens": max_tokens, "dtype": dtype, "threads": threads, "jpeg_decode_s": decode_s,
            "image_tokens": encoded[0].multi_modal.images[0].length, "runs": runs,
            "images_s_ratio": runs[0]["images_s"] / runs[1]["images_s"]}


def print_caption(report: dict) -> None:
    print(f"\n== caption: {report['images']} images x 1 prompt, {report['max_tokens']} tokens each, {report['dtype']}, "
          f"{report['threads']} threads; {report['model']}, {report['image_tokens']} tokens an image")
    print(f"  decoding the JPEGs (load_image): {report['jpeg_decode_s']:.2f} s "
          f"({report['images'] / report['jpeg_decode_s']:.0f} images/s, one thread)")
    for r in report["runs"]:
        print(f"  {r['engine']:18s} {r['images_s']:7.2f} images/s  {r['out_tok_s']:8.1f} out tok/s  "
              f"{r['total_tok_s']:8.1f} tot tok/s  vision encoder {r['vision_seconds']:.2f} s "
              f"= {r['vision_share']:.0%}")
    print(f"  batchgen / transformers: x{report['images_s_ratio']:.2f} images/s")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vision-model", help="a LLaVA or Qwen2-VL directory (default: a random LLaVA built here)")
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="transformers' static batch (rows)")
    args = parser.parse_args(argv)
    report = caption_bench(args.vision_model, args.images, args.max_tokens, args.dtype, args.threads, args.batch_size)
    print_caption(report)
    return report


if __name__ == "__main__":
    main()
