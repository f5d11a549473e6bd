"""The ``batchgen`` command: run, run-batch, ray, validate, status, merge, slurm.

User mistakes surface as ``JobError`` and are printed as one line each on stderr (no traceback);
exit codes are listed in ``batchgen.job.errors``.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from . import __version__
from .job.errors import EXIT_ENGINE, EXIT_ERROR, EXIT_INTERRUPTED, JobError, JobInvalid, Problem
from .job.shard import parse_shard
from .storage import Location, StorageError, is_url, location

# Where each command is told about at length (README sections until the docs/ guides exist); the
# "\b" of click keeps a link on one line however narrow the terminal.
GUIDES = {
    "run": "docs/cli.md", "ray": "docs/ray.md", "run-batch": "docs/openai-batch.md", "merge": "docs/cli.md",
    "validate": "docs/job-file.md", "status": "docs/cli.md", "slurm": "docs/recipes.md", "eval": "docs/evaluation.md",
    "docs": "docs/cli.md",
}

app = typer.Typer(
    name="batchgen",
    help="Offline LLM batch generation: a job file in, Parquet parts out; resumable and shardable.",
    epilog="\b\nGuide: README.md, then docs/ (one guide per topic; batchgen docs lists them, batchgen docs TOPIC "
           "prints one)\nCommands, options and exit codes: docs/cli.md (batchgen docs cli)",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class _Command(TyperCommand):
    """A command whose usage line names its arguments plainly: ``run [OPTIONS] JOB``, where
    typer would write ``{JOB}``."""

    def collect_usage_pieces(self, ctx: typer.Context) -> list[str]:
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in super().collect_usage_pieces(ctx)]


def _command(name: str, short_help: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """``app.command`` with a whole line for the command list and the guide below its help: its path in
    a clone, and the ``batchgen docs`` command that prints it wherever batchgen is installed."""
    guide = GUIDES[name]
    topic = Path(guide.partition("#")[0]).stem
    return app.command(name, cls=_Command, short_help=short_help,
                       epilog=f"\b\nGuide: {guide} (batchgen docs {topic})")


def _show_version(value: bool) -> None:
    if value:
        print(f"batchgen {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option(
        "--version", is_eager=True, callback=_show_version, help="Print batchgen's version and exit.")] = False,
) -> None:
    """Offline LLM batch generation: a job file in, Parquet parts out; resumable and shardable."""


def _shard_text(text: str | None) -> str | None:
    """--shard is checked as the command line is read: a bad one is a usage error (exit 2)."""
    if text is not None:
        try:
            parse_shard(text)
        except JobError as e:
            raise typer.BadParameter(str(e)) from None
    return text


JobFile = Annotated[Path, typer.Argument(metavar="JOB", help="The job file (YAML).", show_default=False)]
Grace = Annotated[float, typer.Option(
    "--grace", min=0, metavar="SECONDS",
    help="After SIGTERM/SIGINT: seconds to let the requests in flight finish (a second signal drops them).")]
Force = Annotated[bool, typer.Option(
    "--force", help="Continue an output dir written with another job configuration.")]
JsonFlag = Annotated[bool, typer.Option(
    "--json", help="Print one JSON object for scripts instead (its fields: docs/cli.md).")]
RetryErrors = Annotated[bool, typer.Option(
    "--retry-errors", help="Generate the rows recorded as errors again (after fixing the input or the job).")]


def _json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False)


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@contextmanager
def _user_errors() -> Iterator[None]:
    """JobError -> its lines on stderr and its exit code; anything else is a bug: traceback, 70."""
    try:
        yield
    except typer.Exit:
        raise
    except JobInvalid as e:
        for p in e.problems:
            _err(f"batchgen: error: {p}")
        raise typer.Exit(e.exit_code) from None
    except JobError as e:
        _err(f"batchgen: error: {e}")
        raise typer.Exit(e.exit_code) from None
    except StorageError as e:  # a bucket problem found outside the job layer's own checks
        _err(f"batchgen: error: {e}")
        raise typer.Exit(EXIT_ERROR) from None
    except KeyboardInterrupt:
        _err("batchgen: aborted; finished parts are kept, run the same command again to resume")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Exception as e:
        traceback.print_exc()
        _err(f"batchgen: internal or engine error: {type(e).__name__}: {e}")
        _err("batchgen: finished rows were saved; run the same command again to resume")
        raise typer.Exit(EXIT_ENGINE) from None


def _warn(warnings: list[str]) -> None:
    """validate's warnings, printed by every command that runs a job too, before it starts (a
    cron job's log shows them)."""
    for warning in warnings:
        _err(f"warning: {warning}")


def _exit(code: int, signal_name: str = "", failure: str | None = None) -> None:
    """Ends a run command with its exit code, telling how to resume after an interruption, or why
    the run failed (``failure``: too many error rows)."""
    if failure:
        _err(f"batchgen: error: {failure}")
    if code == EXIT_INTERRUPTED:
        _err(f"batchgen: interrupted by {signal_name or 'a signal'}; finished rows are saved, "
             "run the same command again to resume")
    raise typer.Exit(code)


@_command("run", "Run a job, or one shard of it; a rerun resumes.")
def run(
    job: JobFile,
    shard: Annotated[str | None, typer.Option(
        "--shard", metavar="I/N", callback=_shard_text,
        help="Run shard I of N, e.g. 0/8; default: the job's shard, then SLURM_ARRAY_TASK_ID/COUNT, else 0/1.")
    ] = None,
    force: Force = False,
    retry_errors: RetryErrors = False,
    grace: Grace = 60.0,
    settings: Annotated[list[str] | None, typer.Option(
        "--set", metavar="FIELD=VALUE",
        help="Change a job field for this run, e.g. --set sampling.max_tokens=16 (a YAML value; repeatable); "
             "checked like the job file.")] = None,
    limit: Annotated[int | None, typer.Option(
        "--limit", min=1, metavar="N",
        help="Only the first N rows, written to OUT_DIR.limit-N beside output.dir (which is not touched).")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Validate, count the rows, estimate prompt tokens and the KV cache; generate nothing.")
    ] = False,
    max_error_rate: Annotated[float | None, typer.Option(
        "--max-error-rate", min=0, max=1, metavar="RATE",
        help="Exit 65 when more than this share of the shard's rows are errors, e.g. 0.05 "
             "(default: output.max_error_rate, else never).")] = None,
    verify: Annotated[bool, typer.Option(
        "--verify", help="Read this shard's parts whole before resuming and set aside any whose bytes changed "
                         "(a flipped byte in a page); otherwise footers and sizes are checked.")] = False,
    engine: Annotated[str | None, typer.Option("--engine", hidden=True)] = None,
) -> None:
    """Run a job (or one shard of it); a rerun resumes where the last one stopped."""
    from .job.engine import load_factory
    from .job.overrides import Overrides
    from .job.run.runner import Runner
    from .job.shard import resolve_shard
    from .job.validate import validate_job_file

    with _user_errors():
        factory = load_factory(engine)
        spec = validate_job_file(job, overrides=Overrides(tuple(settings or ()), limit))
        _warn(spec.warnings)
        the_shard = resolve_shard(shard, spec.spec.shard.index, spec.spec.shard.count)
        if dry_run:
            from .job.run.dry_run import dry_run as plan_run
            from .job.run.dry_run import render

            print(render(plan_run(spec, the_shard, limit)))
            return
        result = Runner(spec, the_shard, factory, force=force, retry_errors=retry_errors, grace=grace,
                        limit=limit, max_error_rate=max_error_rate, verify=verify).run()
    _exit(result.exit_code, result.signal_name, result.failure)


@_command("ray", "Run a job over a Ray cluster, one shard per worker; a rerun resumes.")
def ray_run(
    job: JobFile,
    workers: Annotated[int, typer.Option(
        "--workers", min=1, metavar="N", help="Ray tasks: worker i runs shard i/N.")],
    address: Annotated[str | None, typer.Option(
        "--address", metavar="ADDRESS", help="A running Ray cluster (e.g. auto, ray://head:10001); default: "
                                             "RAY_ADDRESS, else a local one.")] = None,
    gpus_per_worker: Annotated[float, typer.Option(
        "--gpus-per-worker", min=0, metavar="G", help="GPUs Ray gives each worker (fractions allowed).")] = 0.0,
    cpus_per_worker: Annotated[float, typer.Option(
        "--cpus-per-worker", min=0, metavar="C", help="CPUs Ray gives each worker.")] = 1.0,
    max_retries: Annotated[int, typer.Option(
        "--max-retries", min=0, metavar="R", help="Times Ray reruns a worker lost with its node or process.")] = 3,
    force: Force = False,
    retry_errors: RetryErrors = False,
    grace: Grace = 60.0,
    engine: Annotated[str | None, typer.Option("--engine", hidden=True)] = None,
) -> None:
    """Run a job over a Ray cluster: shard i/N of it per worker; a rerun resumes."""
    import os

    from .job.validate import validate_job_file
    from .ray.cluster import HeadUnavailable, import_ray, run_on_ray
    from .storage.mounts import node_local_warning

    with _user_errors():
        import_ray()
        spec = validate_job_file(job)
        _warn(spec.warnings)
        if (address or os.environ.get("RAY_ADDRESS")) and (w := node_local_warning(spec.output_dir)):
            _err(f"warning: {w}")
        try:
            result = run_on_ray(spec, workers, address=address, cpus_per_worker=cpus_per_worker,
                                gpus_per_worker=gpus_per_worker, max_retries=max_retries, engine=engine,
                                force=force, retry_errors=retry_errors, grace=grace)
        except HeadUnavailable as e:
            # The line and exit 75 now: Ray's exit hooks would wait on the lost head until Ray's own limit
            # ends this process with exit 1 and a C++ log line. The driver holds nothing to save (the
            # workers wrote the parts).
            _err(f"batchgen: error: {e}")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(e.exit_code)
    _exit(result.exit_code)


@_command("run-batch", "Run an OpenAI batch request file, as `vllm run-batch` does; resumable.")
def run_batch(
    input_file: Annotated[str, typer.Option(
        "--input", "-i", metavar="REQUESTS",
        help="OpenAI batch request file (JSONL): a path or an s3:// / gs:// URL.")],
    output_file: Annotated[str, typer.Option(
        "--output", "-o", metavar="RESULTS", help="Where to write the OpenAI batch output: a path or a URL.")],
    model: Annotated[str, typer.Option(
        "--model", metavar="MODEL",
        help="Model directory (Hugging Face layout), Hugging Face Hub id, or bucket URL (s3://...).")],
    output_dir: Annotated[str | None, typer.Option(
        "--output-dir", metavar="DIR",
        help="Where the resumable parts go (default: RESULTS.parts next to the output).")] = None,
    revision: Annotated[str | None, typer.Option(
        "--revision", metavar="REV", help="Hub ids: the branch, tag or commit to use (default: main).")] = None,
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", metavar="NAME",
        help="The model name written in responses (default: the model dir's name, or the Hub id).")] = None,
    check_model: Annotated[bool, typer.Option(
        "--check-model", help="A request whose body.model is not the served name becomes an error line.")] = False,
    lora_modules: Annotated[list[str] | None, typer.Option(
        "--lora-modules", metavar="NAME=PATH",
        help="LoRA adapters (PEFT dirs or bucket URLs) that body.model may name, as vLLM's flag: "
             "--lora-modules sql=/adapters/sql chat=/adapters/chat.")] = None,
    max_loras: Annotated[int | None, typer.Option(
        "--max-loras", metavar="N", help="Adapters resident at once (default: all of --lora-modules).")] = None,
    max_cpu_loras: Annotated[int | None, typer.Option(
        "--max-cpu-loras", metavar="N", help="Adapters kept in host memory (default: all).")] = None,
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", metavar="N",
        help="Default for requests without max_tokens (default: until the context ends).")] = None,
    temperature: Annotated[float, typer.Option(
        "--temperature", metavar="T", help="Default for requests without one.")] = 1.0,
    seed: Annotated[int, typer.Option(
        "--seed", metavar="SEED",
        help="Job seed: each request samples reproducibly from it unless its body has a seed.")] = 0,
    dtype: Annotated[str, typer.Option(
        "--dtype", metavar="DTYPE", help="auto, float32, float16 or bfloat16 (auto: the model's).")] = "auto",
    device: Annotated[str, typer.Option(
        "--device", metavar="DEVICE", help="auto, cpu, cuda or cuda:N (auto: cuda when there is one).")] = "auto",
    max_model_len: Annotated[int | None, typer.Option(
        "--max-model-len", metavar="N", help="Prompt and output tokens at most (default: the model's).")] = None,
    max_num_seqs: Annotated[int, typer.Option(
        "--max-num-seqs", metavar="N", help="Sequences in one step (a request's n samples count n).")] = 256,
    max_num_batched_tokens: Annotated[int, typer.Option(
        "--max-num-batched-tokens", metavar="N", help="Tokens in one step; at least --max-num-seqs.")] = 2048,
    block_size: Annotated[int, typer.Option(
        "--block-size", metavar="N", help="Tokens per KV cache block: 8, 16 or 32.")] = 16,
    kv_cache_memory: Annotated[str, typer.Option(
        "--kv-cache-memory", metavar="SIZE", help="The KV cache on CPU, e.g. 4GiB (CUDA: --gpu-memory-utilization).")
    ] = "4GiB",
    swap_space: Annotated[str, typer.Option(
        "--swap-space", metavar="SIZE", help="Host memory that preempted sequences swap to, e.g. 4GiB.")] = "4GiB",
    enable_prefix_caching: Annotated[bool, typer.Option(
        "--enable-prefix-caching/--no-enable-prefix-caching",
        help="Reuse the KV cache of prompts' common prefixes.")] = True,
    preemption_mode: Annotated[str, typer.Option(
        "--preemption-mode", metavar="MODE",
        help="When KV blocks run out: swap (to host memory) or recompute.")] = "swap",
    num_threads: Annotated[int | None, typer.Option(
        "--num-threads", metavar="N", help="CPU threads (default: torch's).")] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(
        "--gpu-memory-utilization", metavar="FRACTION",
        help="CUDA: the share of GPU memory for weights and KV cache (default 0.9).")] = None,
    model_impl: Annotated[str, typer.Option(
        "--model-impl", metavar="IMPL",
        help="auto, native or transformers: batchgen's model code or the model's transformers code.")] = "auto",
    rows_per_part: Annotated[int, typer.Option(
        "--rows-per-part", metavar="N", help="Requests per saved part.")] = 1000,
    force: Annotated[bool, typer.Option("--force", help="Continue parts written with other options.")] = False,
    retry_errors: Annotated[bool, typer.Option("--retry-errors", help="Redo the requests that failed.")] = False,
    grace: Grace = 60.0,
    engine: Annotated[str | None, typer.Option("--engine", hidden=True)] = None,
) -> None:
    """Run an OpenAI batch request file, as `vllm run-batch` does; a rerun resumes."""
    import yaml

    from .job.engine import load_factory
    from .job.run.runner import Runner
    from .job.shard import Shard
    from .job.validate import validate_job_text
    from .models.resolve import model_source

    with _user_errors():
        requests, out = location(input_file), location(output_file)
        if not requests.is_file():
            raise JobError(f"--input: no such request file: {requests}")
        factory = load_factory(engine)
        source = model_source(model)  # the job file lives elsewhere: a local path is made absolute, an id is kept
        model_options = {
            "path": str(Path(source.ref).expanduser().absolute()) if source.kind == "local" else source.ref,
            "revision": revision, "name": served_model_name, "dtype": dtype,
            "device": device, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens, "block_size": block_size,
            "kv_cache_memory": kv_cache_memory, "swap_space": swap_space,
            "enable_prefix_caching": enable_prefix_caching, "preemption_mode": preemption_mode,
            "num_threads": num_threads, "gpu_memory_utilization": gpu_memory_utilization, "model_impl": model_impl,
            "lora_modules": _lora_modules(lora_modules or []), "max_loras": max_loras, "max_cpu_loras": max_cpu_loras}
        job_dict = {
            "model": {k: v for k, v in model_options.items() if v is not None},
            "input": {"paths": [str(requests)], "format": "openai_batch", "check_model": check_model},
            "sampling": {"max_tokens": max_tokens, "temperature": temperature, "seed": seed},
            "output": {"dir": str(location(output_dir) if output_dir else out.with_name(out.name + ".parts")),
                       "format": "openai_batch", "merge_to": str(out), "rows_per_part": rows_per_part},
        }
        text = "# written by batchgen run-batch\n" + yaml.safe_dump(job_dict, sort_keys=False)
        job = validate_job_text(text, out.parent.local if out.is_local else Path.cwd())
        _warn(job.warnings)
        result = Runner(job, Shard(), factory, force=force, retry_errors=retry_errors, grace=grace).run()
    _exit(result.exit_code, result.signal_name, result.failure)


@_command("merge", "Join a JSONL or OpenAI batch output dir into one file, in input order.")
def merge(
    output_dir: Annotated[str, typer.Argument(
        metavar="OUT_DIR", show_default=False,
        help="The job's output.dir (jsonl or openai_batch parts): a path or an s3:// / gs:// URL.")],
    out: Annotated[str, typer.Option(
        "--output", "-o", metavar="FILE", help="The single JSONL file to write: a path or a URL.")],
    partial: Annotated[bool, typer.Option(
        "--partial", help="Write the rows done so far even if some input rows are not done yet.")] = False,
) -> None:
    """Join a JSONL or OpenAI batch output dir into one file, in input order, each row once."""
    from .job.outputs.merge import merge as merge_parts

    with _user_errors():
        merged = merge_parts(_output_dir(output_dir), location(out), partial)
        notes = []
        if merged.missing:
            notes.append(f"{merged.missing:,} input rows not done yet")
        if merged.extra:
            notes.append(f"{merged.extra:,} rows no longer in the input, at the end")
        note = f" ({'; '.join(notes)})" if notes else ""
        print(f"wrote {merged.lines:,} lines for {merged.rows + merged.extra:,} rows to {merged.path}{note}")


@_command("validate", "Check a job file, its model and its input; list every problem.")
def validate(
    job: JobFile,
    ray: Annotated[bool, typer.Option(
        "--ray", help="Also warn when the output dir looks local to this machine (for batchgen ray).")] = False,
    as_json: JsonFlag = False,
    engine: Annotated[str | None, typer.Option("--engine", hidden=True)] = None,
) -> None:
    """Check a job file, its model (without loading the weights) and its input files; list every problem."""
    from .job.engine import load_factory
    from .job.validate import check_rows, validate_job_file
    from .storage.mounts import node_local_warning

    try:
        spec = validate_job_file(job, load_factory(engine))
        check_rows(spec)
    except JobError as e:
        problems = e.problems if isinstance(e, JobInvalid) else [Problem("", str(e))]
        if as_json:
            print(_json(_validation(job, problems, [])))
        elif isinstance(e, JobInvalid):
            for p in e.problems:
                _err(str(p))
            _err(f"{len(e.problems)} problem{'s' if len(e.problems) != 1 else ''} in {job}")
        else:
            _err(f"batchgen: error: {e}")
        raise typer.Exit(e.exit_code) from None
    if ray and (local := node_local_warning(spec.output_dir)):
        spec.warnings.append(local)
    if as_json:
        print(_json(_validation(job, [], spec.warnings)))
        return
    _warn(spec.warnings)
    print("ok")


VALIDATE_SCHEMA = 1  # the version of ``validate --json``'s layout (docs/cli.md)


def _validation(job: Path, problems: list[Problem], warnings: list[str]) -> dict[str, Any]:
    """``validate --json``'s object: ok, every problem by field, every warning."""
    return {"schema": VALIDATE_SCHEMA, "job": str(job), "ok": not problems,
            "problems": [{"field": p.path, "message": p.message} for p in problems], "warnings": warnings}


@_command("status", "Show rows done, errors and rows still missing, per shard.")
def status(
    output_dir: Annotated[str, typer.Argument(
        metavar="OUT_DIR|JOB", show_default=False,
        help="The job's output.dir (a path or an s3:// / gs:// URL), or the job file, whose output.dir is read.")],
    no_input: Annotated[bool, typer.Option(
        "--no-input", help="Do not read the input to count missing rows.")] = False,
    verify: Annotated[bool, typer.Option(
        "--verify", help="Read every part whole and check it (page checksums, content hashes): slower, finds a "
                         "flipped byte that footers and sizes do not show.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Show rows done, errors and rows still missing, per shard."""
    from .job.run.status import as_json as status_json
    from .job.run.status import collect, render

    with _user_errors():
        report = collect(_status_dir(output_dir), with_input=not no_input, verify=verify)
        print(_json(status_json(report)) if as_json else render(report))


@_command("slurm", "Write an sbatch script that runs the job as a Slurm array, one shard per task.")
def slurm(
    job: JobFile,
    array: Annotated[int, typer.Option(
        "--array", metavar="N", help="Number of array tasks (= shards); task i runs shard i/N.")],
    time: Annotated[str, typer.Option("--time", metavar="HH:MM:SS", help="Time limit per task.")] = "04:00:00",
    gpus: Annotated[int, typer.Option("--gpus", metavar="N", help="GPUs per task (0: none).")] = 1,
    partition: Annotated[str | None, typer.Option(
        "--partition", metavar="NAME", help="Slurm partition (default: the cluster's).")] = None,
    account: Annotated[str | None, typer.Option(
        "--account", metavar="NAME", help="Slurm account to charge (default: yours).")] = None,
    cpus_per_task: Annotated[int | None, typer.Option(
        "--cpus-per-task", metavar="N", help="CPUs per task (default: Slurm's).")] = None,
    mem: Annotated[str | None, typer.Option(
        "--mem", metavar="SIZE", help="Memory per task, in Slurm's form, e.g. 32G (default: Slurm's).")] = None,
    max_parallel: Annotated[int | None, typer.Option(
        "--max-parallel", metavar="N", help="Tasks running at once (default: all).")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", metavar="FILE", help="Where to write the script (default: the job file with .sbatch).")] = None,
) -> None:
    """Write an sbatch script running the job as a Slurm array, one shard per task."""
    from .job.run.slurm import SlurmOptions, write_script
    from .job.validate import validate_job_file

    with _user_errors():
        spec = validate_job_file(job)
        opts = SlurmOptions(array=array, time=time, gpus=gpus, partition=partition, account=account,
                            cpus_per_task=cpus_per_task, mem=mem, max_parallel=max_parallel)
        path = write_script(spec, job.resolve(), opts, out)
        print(f"wrote {path}; submit with: sbatch {path}")


@_command("docs", "List the guides, or print one: batchgen docs cli.")
def docs(
    topic: Annotated[str | None, typer.Argument(
        metavar="TOPIC", show_default=False,
        help="The guide to print: its file's name without .md (cli, job-file, buckets, ...; readme).")] = None,
) -> None:
    """List the guides (README.md and docs/*.md, shipped with batchgen), or print the one named."""
    from .guides import guide_files, guide_text, title

    if topic is None:
        for name, path in guide_files().items():
            print(f"{name:<20} {title(path)}")
        return
    try:
        print(guide_text(topic), end="")
    except LookupError as e:
        _err(f"batchgen: error: {e.args[0]}")
        raise typer.Exit(EXIT_ERROR) from None


def _output_dir(text: str) -> Location:
    """An existing output dir (local or a bucket prefix holding a run's files)."""
    out = location(text)
    if not out.is_dir():
        raise JobError(f"no such output dir: {out}")
    return out


def _status_dir(text: str) -> Location:
    """The output dir ``status`` reads: the one named, or the ``output.dir`` of a job file."""
    given = location(text)
    if not (given.is_local and given.local.is_file()):
        return _output_dir(text)
    from .job.spec import load_job

    out = load_job(given.local).output_dir
    if not out.is_dir():
        raise JobError(f"no such output dir: {out} (output.dir of {text}); no run of this job has started")
    return out


def _lora_modules(pairs: list[str]) -> dict[str, str] | None:
    """``--lora-modules`` values as ``model.lora_modules`` (a local path made absolute: the job file lives
    elsewhere)."""
    modules = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise JobError(f"--lora-modules: expected NAME=PATH, got {pair!r}")
        modules[name] = path if is_url(path) else str(Path(path).expanduser().absolute())
    return modules or None


def spread_lora_modules(args: list[str]) -> list[str]:
    """vLLM's spelling, ``--lora-modules a=PATH b=PATH``, as one flag per adapter (what typer reads)."""
    out: list[str] = []
    values: int | None = None  # values read after --lora-modules; None: not in its list
    for arg in args:
        if arg.startswith("-"):
            values = 0 if arg == "--lora-modules" else None
        elif values is not None:
            if values:
                out.append("--lora-modules")
            values += 1
        out.append(arg)
    return out


@app.command("eval", cls=_Command, short_help="Run lm-evaluation-harness on batchgen (lm-eval's own options).",
             epilog=f"\b\nGuide: {GUIDES['eval']}", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def evaluate(ctx: typer.Context) -> None:
    """lm-eval's command line with `--model batchgen` unless another --model is given, e.g.
    `batchgen eval --model_args pretrained=PATH,dtype=bfloat16 --tasks hellaswag --output_path out/`;
    every option is lm-eval's (`batchgen eval --help` lists them). Needs `pip install lm-eval`."""
    try:
        from .integrations.lm_eval import run_cli
    except ImportError as e:
        _err(f"batchgen: error: batchgen eval needs lm-evaluation-harness: pip install 'lm-eval>=0.4.13' ({e})")
        raise typer.Exit(EXIT_ERROR) from None
    raise typer.Exit(run_cli(list(ctx.args)))


def main() -> None:
    """The ``batchgen`` command. Once the command is over (its rows saved, its exit code known) the process
    leaves with ``os._exit``, after Python's exit handlers: finalizing the interpreter tears down native thread
    pools (Arrow's, the tokenizer's) and stops daemon threads, and a thread caught inside C++ then ends it in
    std::terminate (SIGABRT, exit -6, "terminate called without an active exception"). A run that saved its rows
    and exits 75 for a requeue must not turn into a crash on its way out."""
    try:
        app(args=spread_lora_modules(sys.argv[1:]))
        code = 0
    except SystemExit as e:
        code = _exit_status(e.code)
    _leave(code)


def _exit_status(code: object) -> int:
    """What ``sys.exit(code)`` ends the process with: None 0, an int itself, anything else printed and 1."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def _leave(code: int) -> None:
    import atexit
    import os

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said on it
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
