"""batchgen as an lm-evaluation-harness backend gives the numbers of lm-eval's own `hf` backend.

Three local tasks, one of each output type (multiple_choice, generate_until, loglikelihood_rolling), defined in
YAML over JSONL files written here (no hub), run through `lm_eval.simple_evaluate` with `hf` and with `batchgen`
on the same tiny float32 model: per-request loglikelihoods within 1e-4, the same acc and acc_norm, the same
greedy generations, word_perplexity within 1e-4 relative.
"""

from __future__ import annotations

import json
import math

import pytest

from batchgen.integrations.lm_eval import BatchgenLM, ModelArgsError

QUESTIONS = [
    ("The sea is", [" blue", " loud", " a cat", " never"], 0),
    ("Paris is the capital of", [" France", " Spain", " the moon"], 0),
    ("One plus one is", [" two", " three", " eleven", " a word with many tokens in it"], 0),
    ("Cats like to", [" sleep", " fly"], 1),
    ("The quick brown fox", [" jumps", " sits", " runs away"], 2),
    ("A haiku has", [" three lines", " no lines"], 0),
]
TEXTS = ["the sea is blue and the sky is wide, and the fox jumps over the lazy dog " * 3,
         "a short text", "Paris is the capital of France. It is a large city with many people in it."]


def write_tasks(root):
    """Three task YAMLs and their JSONL data under root; returns the tasks' names."""
    data = {"mc": [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS],
            "gen": [{"question": q, "answer": c[a]} for q, c, a in QUESTIONS],
            "ppl": [{"text": t} for t in TEXTS]}
    for name, rows in data.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ntest_split: train\ndataset_kwargs:\n  data_files:\n    train: {path}\n"
    tasks = {
        "tiny_mc": "output_type: multiple_choice\ndoc_to_text: '{{{{question}}}}'\ndoc_to_choice: '{{{{choices}}}}'\n"
                   "doc_to_target: '{{{{answer}}}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        "tiny_gen": "output_type: generate_until\ndoc_to_text: '{{{{question}}}}'\ndoc_to_target: '{{{{answer}}}}'\n"
                    "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 12\n  do_sample: false\n"
                    "metric_list:\n  - metric: exact_match\n",
        "tiny_ppl": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{{{text}}}}'\n"
                    "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
                    "  - metric: bits_per_byte\n",
    }
    for (task, body), name in zip(tasks.items(), data, strict=True):
        text = f"task: {task}\n" + common.format(path=root / f"{name}.jsonl") + body.format()
        (root / f"{task}.yaml").write_text(text)
    return list(tasks)


def evaluate(model: str, model_args: str, tasks: list[str], include: str) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=TaskManager(
        include_path=include), log_samples=True, batch_size=4, device="cpu", random_seed=0, numpy_random_seed=0,
        torch_random_seed=0, fewshot_random_seed=0)


def responses(result: dict, task: str) -> list:
    return [s["resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


@pytest.fixture(scope="module")
def both(tiny_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    tasks = write_tasks(root)
    model = tiny_model_dirs["llama"]
    hf = evaluate("hf", f"pretrained={model},dtype=float32", tasks, str(root))
    ours = evaluate("batchgen", f"pretrained={model},dtype=float32,kv_cache_memory=64MiB", tasks, str(root))
    return hf, ours


def test_loglikelihoods_and_accuracy_match_the_hf_backend(both):
    hf, ours = both
    want, got = responses(hf, "tiny_mc"), responses(ours, "tiny_mc")
    assert len(got) == len(QUESTIONS) and sum(len(r) for r in got) == sum(len(c) for _, c, _ in QUESTIONS)
    for w, g in zip(want, got, strict=True):
        for (w_ll, w_greedy), (g_ll, g_greedy) in ((x[0], y[0]) for x, y in zip(w, g, strict=True)):
            assert abs(float(w_ll) - float(g_ll)) < 1e-4 and w_greedy == g_greedy
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["tiny_mc"][metric] == hf["results"]["tiny_mc"][metric]


def test_greedy_generations_match_the_hf_backend(both):
    hf, ours = both
    got = responses(ours, "tiny_gen")
    assert got == responses(hf, "tiny_gen")
    assert any(r[0][0].strip() for r in got)  # the model wrote something
    assert ours["results"]["tiny_gen"]["exact_match,none"] == hf["results"]["tiny_gen"]["exact_match,none"]


def test_rolling_perplexity_matches_the_hf_backend(both):
    hf, ours = both
    for w, g in zip(responses(hf, "tiny_ppl"), responses(ours, "tiny_ppl"), strict=True):
        assert math.isclose(float(w[0][0]), float(g[0][0]), rel_tol=1e-5, abs_tol=1e-4)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert math.isclose(ours["results"]["tiny_ppl"][metric], hf["results"]["tiny_ppl"][metric], rel_tol=1e-4)


def test_model_args_errors_name_the_argument(tiny_model_dirs, tmp_path):
    with pytest.raises(ModelArgsError, match="unknown argument 'max_sequence'"):
        BatchgenLM.create_from_arg_string(f"pretrained={tiny_model_dirs['llama']},max_sequence=5")
    with pytest.raises(ModelArgsError, match="lora_local_path: no PEFT adapter at"):
        BatchgenLM.create_from_arg_string(f"pretrained={tiny_model_dirs['llama']},lora_local_path={tmp_path}")
    with pytest.raises(ModelArgsError, match="--model_args: model path .* does not exist"):
        BatchgenLM.create_from_arg_string(f"pretrained={tmp_path / 'missing'}")


def test_lm_eval_knows_batchgen_and_keeps_its_own_models():
    from lm_eval.api.registry import get_model

    assert get_model("batchgen") is BatchgenLM
    assert get_model("hf").__name__ == "HFLM"


def test_batchgen_eval_runs_lm_evals_command_line(tiny_model_dirs, tmp_path):
    """`batchgen eval` is lm-eval's CLI with --model batchgen: a local task into --output_path; a bad
    --model_args entry is one line and exit 1."""
    import subprocess
    import sys

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_tasks(tasks)
    base = [sys.executable, "-m", "batchgen", "eval", "--tasks", "tiny_mc", "--include_path", str(tasks),
            "--limit", "2", "--device", "cpu"]
    model = f"pretrained={tiny_model_dirs['llama']},dtype=float32,kv_cache_memory=64MiB"
    done = subprocess.run([*base, "--model_args", model, "--output_path", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = (tmp_path / "out").rglob("results_*.json")
    assert json.loads(result.read_text())["results"]["tiny_mc"]["acc,none"] is not None
    bad = subprocess.run([*base, "--model_args", model + ",max_sequence=5"], capture_output=True, text=True,
                         timeout=600)
    assert bad.returncode == 1
    assert "batchgen: error: --model_args: unknown argument 'max_sequence'" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_the_guides_local_task_runs_from_the_command_line_and_python(tiny_model_dirs, tmp_path, monkeypatch):
    """docs/evaluation.md's task files, its `batchgen eval` command and its Python example, on the tiny model."""
    import os
    import shlex
    import subprocess
    import sys

    from test_readme import block, commands

    smollm2 = "~/.cache/batchgen/models/SmolLM2-135M-Instruct"
    for name in ("tasks/capitals.yaml", "tasks/capitals.jsonl"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(block("file", name))
    (command,) = commands(block("eval").replace("\\\n", " "))
    argv = shlex.split(command.replace(smollm2, str(tiny_model_dirs["llama"])))
    assert argv[:2] == ["batchgen", "eval"]
    bin_dir = os.path.dirname(sys.executable)
    done = subprocess.run([os.path.join(bin_dir, "batchgen"), *argv[1:]], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = (tmp_path / "out" / "eval").rglob("results_*.json")
    assert 0 <= json.loads(result.read_text())["results"]["capitals"]["acc,none"] <= 1
    monkeypatch.chdir(tmp_path)
    code = block("python", "lm-eval").replace(smollm2, str(tiny_model_dirs["llama"]))
    exec(compile(code, "docs/evaluation.md", "exec"), {})
