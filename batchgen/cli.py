"""The ``batchgen`` command: run, run-batch, ray, validate, status, merge, slurm.

User mistakes surface as ``JobError`` and are printed as one line each on stderr (no traceback);
exit codes are listed in ``batchgen.job.errors``.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from .job.errors import EXIT_ENGINE, EXIT_ERROR, EXIT_INTERRUPTED, JobError, JobInvalid
from .storage import StorageError, location

app = typer.Typer(
    name="batchgen",
    help="Offline LLM batch generation: a job file in, Parquet parts out; resumable and shardable.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


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


def _exit(code: int, signal_name: str = "") -> None:
    """Ends a run command with its exit code, telling how to resume after an interruption."""
    if code == EXIT_INTERRUPTED:
        _err(f"batchgen: interrupted by {signal_name or 'a signal'}; finished rows are saved, "
             "run the same command again to resume")
    raise typer.Exit(code)


@app.command()
def run(
    job: Annotated[Path, typer.Argument(help="The job file (YAML).")],
    shard: Annotated[str | None, typer.Option(
        "--shard", help="INDEX/COUNT, e.g. 0/8; default: job file, then SLURM_ARRAY_TASK_ID/COUNT.")] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Continue an output dir written with another job configuration.")] = False,
    retry_errors: Annotated[bool, typer.Option(
        "--retry-errors", help="Generate the rows recorded as errors again (after fixing the input or job).")] = False,
    grace: Annotated[float, typer.Option(
        "--grace", min=0, help="Seconds to let in-flight requests finish after SIGTERM/SIGINT.")] = 60.0,
    engine: Annotated[str | None, typer.Option("--engine", hidden=True)] = None,
) -> None:
    """Run a job (or one shard of it); a rerun resumes where the last one stopped."""
    from .job.engine import load_factory
    from .job.runner import Runner
    from .job.shard import resolve_shard
    from .job.validate import validate_job_file

    with _user_errors():
        factory = load_factory(engine)
        spec = validate_job_file(job)
        _warn(spec.warnings)
        the_shard = resolve_shard(shard, spec.spec.shard.index, spec.spec.shard.count)
        result = Runner(spec, the_shard, factory, force=force, retry_errors=retry_errors, grace=grace).run()
    _exit(result.exit_code, result.signal_name)


@app.command("ray")
def ray_run(
    job: Annotated[Path, typer.Argument(help="The job file (YAML).")],
    workers: Annotated[int, typer.Option("--workers", min=1, help="Ray tasks, one shard each.")],
    address: Annotated[str | None, typer.Option(
        "--address", help="A running Ray cluster (e.g. auto, ray://head:10001); default: RAY_ADDRESS, "
                          "else a local one.")] = None,
    gpus_per_worker: Annotated[float, typer.Option("--gpus-per-worker", min=0)] = 0.0,
    cpus_per_worker: Annotated[float, typer.Option("--cpus-per-worker", min=0)] = 1.0,
    max_retries: Annotated[int, typer.Option(
        "--max-retries", min=0, help="Times Ray reruns a worker lost with its node or process.")] = 3,
    force: Annotated[bool, typer.Option("--force", help="Continue an output dir of another configuration.")] = False,
    retry_errors: Annotated[bool, typer.Option("--retry-errors", help="Generate the error rows again.")] = False,
    grace: Annotated[float, typer.Option("--grace", min=0)] = 60.0,
    engine: Annotated[str | None, typer.Option("--engine", hidden=True)] = None,
) -> None:
    """Run a job over a Ray cluster: shard i/N of it per worker; a rerun resumes."""
    import os

    from .job.validate import validate_job_file
    from .ray.cluster import import_ray, run_on_ray
    from .storage.mounts import node_local_warning

    with _user_errors():
        import_ray()
        spec = validate_job_file(job)
        _warn(spec.warnings)
        if (address or os.environ.get("RAY_ADDRESS")) and (w := node_local_warning(spec.output_dir)):
            _err(f"warning: {w}")
        result = run_on_ray(spec, workers, address=address, cpus_per_worker=cpus_per_worker,
                            gpus_per_worker=gpus_per_worker, max_retries=max_retries, engine=engine,
                            force=force, retry_errors=retry_errors, grace=grace)
    _exit(result.exit_code)


@app.command("run-batch")
def run_batch(
    input_file: Annotated[str, typer.Option(
        "--input", "-i", help="OpenAI batch request file (JSONL): a path or an s3:// / gs:// URL.")],
    output_file: Annotated[str, typer.Option(
        "--output", "-o", help="Where to write the OpenAI batch output: a path or a URL.")],
    model: Annotated[str, typer.Option(
        "--model", help="Model directory (Hugging Face layout), Hugging Face Hub id, or bucket URL (s3://...).")],
    output_dir: Annotated[str | None, typer.Option(
        "--output-dir", help="Where the resumable parts go (default: OUTPUT.parts next to the output).")] = None,
    revision: Annotated[str | None, typer.Option(
        "--revision", help="Hub ids: the branch, tag or commit to use (default: main).")] = None,
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", help="The model name written in responses (default: the model dir's name, "
                                    "or the Hub id).")] = None,
    check_model: Annotated[bool, typer.Option(
        "--check-model", help="A request whose body.model is not the served name becomes an error line.")] = False,
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", help="Default for requests without max_tokens (default: until the context ends).")] = None,
    temperature: Annotated[float, typer.Option("--temperature", help="Default for requests without one.")] = 1.0,
    seed: Annotated[int, typer.Option(
        "--seed", help="Job seed: each request samples reproducibly from it unless its body has a seed.")] = 0,
    dtype: Annotated[str, typer.Option("--dtype")] = "auto",
    device: Annotated[str, typer.Option("--device")] = "auto",
    max_model_len: Annotated[int | None, typer.Option("--max-model-len")] = None,
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs")] = 256,
    max_num_batched_tokens: Annotated[int, typer.Option("--max-num-batched-tokens")] = 2048,
    block_size: Annotated[int, typer.Option("--block-size")] = 16,
    kv_cache_memory: Annotated[str, typer.Option("--kv-cache-memory")] = "4GiB",
    swap_space: Annotated[str, typer.Option("--swap-space")] = "4GiB",
    enable_prefix_caching: Annotated[bool, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching")] = True,
    preemption_mode: Annotated[str, typer.Option("--preemption-mode", help="swap or recompute")] = "swap",
    num_threads: Annotated[int | None, typer.Option("--num-threads")] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option("--gpu-memory-utilization")] = None,
    model_impl: Annotated[str, typer.Option("--model-impl", help="auto, native or transformers")] = "auto",
    rows_per_part: Annotated[int, typer.Option("--rows-per-part", help="Requests per saved part.")] = 1000,
    force: Annotated[bool, typer.Option("--force", help="Continue parts written with other options.")] = False,
    retry_errors: Annotated[bool, typer.Option("--retry-errors", help="Redo the requests that failed.")] = False,
    grace: Annotated[float, typer.Option("--grace", min=0)] = 60.0,
    engine: Annotated[str | None, typer.Option("--engine", hidden=True)] = None,
) -> None:
    """Run an OpenAI batch request file, as `vllm run-batch` does; a rerun resumes."""
    import yaml

    from .job.engine import load_factory
    from .job.runner import Runner
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
            "num_threads": num_threads, "gpu_memory_utilization": gpu_memory_utilization, "model_impl": model_impl}
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
    _exit(result.exit_code, result.signal_name)


@app.command()
def merge(
    output_dir: Annotated[str, typer.Argument(
        help="The job's output.dir (jsonl or openai_batch parts): a path or an s3:// / gs:// URL.")],
    out: Annotated[str, typer.Option("--output", "-o", help="The single JSONL file to write: a path or a URL.")],
    partial: Annotated[bool, typer.Option(
        "--partial", help="Write the rows done so far even if some input rows are not done yet.")] = False,
) -> None:
    """Join a JSONL or OpenAI batch output dir into one file, in input order, each row once."""
    from .job.merge import merge as merge_parts

    with _user_errors():
        merged = merge_parts(_output_dir(output_dir), location(out), partial)
        notes = []
        if merged.missing:
            notes.append(f"{merged.missing:,} input rows not done yet")
        if merged.extra:
            notes.append(f"{merged.extra:,} rows no longer in the input, at the end")
        note = f" ({'; '.join(notes)})" if notes else ""
        print(f"wrote {merged.lines:,} lines for {merged.rows + merged.extra:,} rows to {merged.path}{note}")


@app.command()
def validate(
    job: Annotated[Path, typer.Argument(help="The job file (YAML).")],
    ray: Annotated[bool, typer.Option(
        "--ray", help="Also warn when the output dir looks local to this machine (for batchgen ray).")] = False,
    engine: Annotated[str | None, typer.Option("--engine", hidden=True)] = None,
) -> None:
    """Check a job file, its model (without loading the weights) and its input files; list every problem."""
    from .job.engine import load_factory
    from .job.validate import validate_job_file
    from .storage.mounts import node_local_warning

    try:
        spec = validate_job_file(job, load_factory(engine))
    except JobInvalid as e:
        for p in e.problems:
            _err(str(p))
        _err(f"{len(e.problems)} problem{'s' if len(e.problems) != 1 else ''} in {job}")
        raise typer.Exit(e.exit_code) from None
    except JobError as e:
        _err(f"batchgen: error: {e}")
        raise typer.Exit(e.exit_code) from None
    if ray and (local := node_local_warning(spec.output_dir)):
        spec.warnings.append(local)
    _warn(spec.warnings)
    print("ok")


@app.command()
def status(
    output_dir: Annotated[str, typer.Argument(help="The job's output.dir: a path or an s3:// / gs:// URL.")],
    no_input: Annotated[bool, typer.Option(
        "--no-input", help="Do not read the input to count missing rows.")] = False,
) -> None:
    """Show rows done, errors and rows still missing, per shard."""
    from .job.status import collect, render

    with _user_errors():
        print(render(collect(_output_dir(output_dir), with_input=not no_input)))


@app.command()
def slurm(
    job: Annotated[Path, typer.Argument(help="The job file (YAML).")],
    array: Annotated[int, typer.Option("--array", help="Number of array tasks (= shards).")],
    time: Annotated[str, typer.Option("--time", help="Time limit per task.")] = "04:00:00",
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs per task (0: none).")] = 1,
    partition: Annotated[str | None, typer.Option("--partition")] = None,
    account: Annotated[str | None, typer.Option("--account")] = None,
    cpus_per_task: Annotated[int | None, typer.Option("--cpus-per-task")] = None,
    mem: Annotated[str | None, typer.Option("--mem")] = None,
    max_parallel: Annotated[int | None, typer.Option("--max-parallel", help="Tasks at once.")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Where to write the script (default: the job file with .sbatch).")] = None,
) -> None:
    """Write an sbatch script running the job as a Slurm array, one shard per task."""
    from .job.slurm import SlurmOptions, write_script
    from .job.validate import validate_job_file

    with _user_errors():
        spec = validate_job_file(job)
        opts = SlurmOptions(array=array, time=time, gpus=gpus, partition=partition, account=account,
                            cpus_per_task=cpus_per_task, mem=mem, max_parallel=max_parallel)
        path = write_script(spec, job.resolve(), opts, out)
        print(f"wrote {path}; submit with: sbatch {path}")


def _output_dir(text: str):
    """An existing output dir (local or a bucket prefix holding a run's files)."""
    out = location(text)
    if not out.is_dir():
        raise JobError(f"no such output dir: {out}")
    return out


def main() -> None:
    app()


if __name__ == "__main__":
    main()
