"""scripts/bench.py's caption workload (scripts/bench_caption.py; issue 55), a --quick pass on the tiny random LLaVA:
both engines make the same number of tokens on the same images, and the report has every number it prints."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from vision_kit import build_llava

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_caption_workload_quick(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    bench = load("bench")
    model = build_llava(tmp_path / "llava")
    report = bench.main(["--quick", "--dtype", "fp32", "--workloads", "caption", "--vision-model", str(model)])
    caption = report["caption"]["float32"]
    ours, peer = caption["runs"]
    assert (ours["engine"], peer["engine"]) == ("batchgen", "transformers-b4")
    assert ours["images"] == peer["images"] == 4 and caption["image_tokens"] == 16
    assert ours["output_tokens"] == peer["output_tokens"] == 4 * 4  # ignore_eos: max_tokens an image on both
    assert ours["prompt_tokens"] == peer["prompt_tokens"]  # the same encoded prompts
    assert 0 < ours["vision_share"] < 1 and 0 < peer["vision_share"] < 1
    assert report["runs"] == []  # no text workload was asked for
    out = capsys.readouterr().out
    assert "== caption: 4 images x 1 prompt, 4 tokens each, float32" in out and "batchgen / transformers: x" in out
