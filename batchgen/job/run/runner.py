"""Runs one shard of a job: input rows -> engine (bounded in flight) -> Parquet parts.

Exactly-once comes from the writer (a row is done when its part exists) and the reader
(skips done ids); the runner only has to never write a row twice within a run and to save
finished rows before it exits for any reason except SIGKILL.

Signals: the first SIGTERM/SIGINT stops admitting rows, saves what is finished and lets the
in-flight requests finish for up to ``grace`` seconds; a second one drops them at once (they are
redone next run); a third aborts immediately. An interrupted run exits with 75.
"""

from __future__ import annotations

import itertools
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ... import __version__
from ...engine.gc_pacing import fewer_collections
from ...images import ImageError
from ...outputs import RequestOutput
from ...storage.scratch import sweep_orphans
from ..engine import EngineFactory, build_engine
from ..errors import EXIT_ERROR_RATE, EXIT_INTERRUPTED, EXIT_OK, JobError, JobInvalid
from ..images import RowImages, has_images, image_memory, takes_images
from ..inputs import InputReader, Row, ignored_summary
from ..inputs.rows import EMBEDDING
from ..outputs import saved
from ..outputs.formats import part_format
from ..outputs.merge import merge
from ..outputs.openai_batch import ResponseLines
from ..outputs.task_rows import TaskShape, task_shape
from ..outputs.texts import TextPlan, decode_texts
from ..outputs.writer import PartWriter, SampleRows, list_parts, output_schema, recover
from ..params import RowParamsError
from ..requests import RequestBuilder
from ..shard import Shard
from ..spec import Job
from ..validate import max_tokens_warning
from .feeder import CHUNK_ROWS, IMAGE_CHUNK_ROWS, PreparedRow, RowFeeder
from .lock import ShardLock
from .progress import Plan, Reporter, Snapshot, engine_steps, make_reporter

GRACE_FLUSH_SECONDS = 5.0  # while draining after a stop request, save finished rows this often
STATS_SECONDS = 0.2


class StopFlag:
    """Counts SIGTERM/SIGINT; the run loop polls it (a handler must not do real work)."""

    def __init__(self) -> None:
        self.count = 0
        self.signal_name = ""

    def __call__(self, signum: int, frame: object) -> None:
        self.count += 1
        self.signal_name = signal.Signals(signum).name
        if self.count >= 3:
            raise KeyboardInterrupt

    @property
    def requested(self) -> bool:
        return self.count > 0

    @contextmanager
    def installed(self) -> Iterator[StopFlag]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        old = {s: signal.signal(s, self) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)


@dataclass
class PendingRow:
    """A row whose requests are in the engine: their outputs, in the row's order, as they come."""

    row: Row
    outputs: list[Any]
    image_bytes: int = 0  # what its decoded images hold (they stay in the engine until it finishes)

    @property
    def complete(self) -> bool:
        return all(out is not None for out in self.outputs)


@dataclass
class RunResult:
    status: str  # "complete" | "interrupted" | "nothing to do"
    plan: Plan
    snapshot: Snapshot
    signal_name: str = ""
    warnings: list[str] = field(default_factory=list)
    failure: str | None = None  # more error rows than the job allows (``error_rate_failure``)

    @property
    def exit_code(self) -> int:
        if self.status == "interrupted":
            return EXIT_INTERRUPTED
        return EXIT_ERROR_RATE if self.failure else EXIT_OK


def error_rate_failure(errors: int, rows: int, max_rate: float | None, shard: Shard) -> str | None:
    """Why a run fails for its error rows: more than ``max_rate`` of the shard's ``rows`` (done before
    included) are errors; None when they are not, or no rate is set."""
    if max_rate is None or rows == 0 or errors <= max_rate * rows:
        return None
    return (f"{errors:,} of the {rows:,} rows of shard {shard} are errors ({100 * errors / rows:.1f}%), more than "
            f"the {100 * max_rate:g}% allowed (--max-error-rate or output.max_error_rate); the rows are saved, "
            "each with its error column")


def shard_total(reader: InputReader, shard: Shard, limit: int | None = None) -> tuple[int | None, bool]:
    """(rows of ``shard`` in the input, exact?) without reading the rows: a shard's share is estimated;
    ``limit`` caps it (exactly, where the input has that many)."""
    total, exact = reader.total_rows()
    if total is not None and shard.count > 1:
        total, exact = round(total / shard.count), False
    if limit is not None and (total is None or total >= limit):
        return limit, total is not None
    return total, exact


class Runner:
    def __init__(self, job: Job, shard: Shard, engine_factory: EngineFactory, *, force: bool = False,
                 retry_errors: bool = False, grace: float = 60.0, reporter: Reporter | None = None,
                 stop: StopFlag | None = None, lock_wait: float = 0.0, limit: int | None = None,
                 max_error_rate: float | None = None, verify: bool = False):
        """``lock_wait``: seconds to wait for the shard's lock when another run holds it. ``limit``
        (``run --limit``): the shard's first rows only (the job's output dir is the trial one already).
        ``max_error_rate`` (``run --max-error-rate``): instead of ``output.max_error_rate``. ``verify``
        (``run --verify``): the shard's parts are read whole and checked before resuming."""
        self.job = job
        self.shard = shard
        self.engine_factory = engine_factory
        self.force = force
        self.retry_errors = retry_errors
        self.verify = verify
        self.grace = grace
        self.reporter = reporter or make_reporter(job.spec.progress_interval)
        self.stop = stop or StopFlag()
        self.lock_wait = lock_wait
        self.limit = limit
        self.max_error_rate = max_error_rate if max_error_rate is not None else job.spec.output.max_error_rate
        self._records: SampleRows | ResponseLines = SampleRows()  # what a finished or failed row becomes
        self._text = TextPlan()  # who decodes the outputs' text
        self._images: RowImages | None = None  # how rows get their images (None: the model takes none)
        self._image_bytes = 0  # decoded images of the rows in flight

    def run(self) -> RunResult:
        with self.stop.installed():
            return self._run()

    # ------------------------------------------------------------------------------------ setup

    def _run(self) -> RunResult:
        job, shard = self.job, self.shard
        out_dir = job.output_dir
        reader = InputReader.for_job(job)
        problems = reader.check()
        if problems:
            raise JobInvalid(problems)
        try:
            out_dir.prepare_dir()
        except OSError as e:
            raise JobError(f"cannot create output dir {out_dir}: {e}") from None
        lock = ShardLock(out_dir, shard, job.spec.storage.lease).acquire(self.lock_wait, self.reporter.message)
        swept = sweep_orphans()
        if swept:
            self.reporter.message(f"removed {swept} scratch file(s) that killed runs left in {tempfile.gettempdir()}")
        try:
            with engine_steps(self.reporter):
                return self._run_locked(reader, lock)
        finally:
            lock.release()

    def _run_locked(self, reader: InputReader, lock: ShardLock) -> RunResult:
        job, shard, out_dir = self.job, self.shard, self.job.output_dir
        if lock.warning:
            self.reporter.message(f"warning: {lock.warning}")
        saved.check_saved(out_dir, job, self.force)
        rec = recover(out_dir, shard, job.config_hash, self.force, self.retry_errors, self.verify)
        saved.save(out_dir, job)
        total, exact = shard_total(reader, shard, self.limit)
        if self.limit is not None:
            self.reporter.message(f"--limit {self.limit:,}: the first {self.limit:,} rows of shard {shard} only, "
                                  f"written to {out_dir} (the job's own output.dir is not touched)")
        plan = Plan(shard, done_before=rec.done_here, total=total, exact=exact, task=job.spec.task)
        for line in rec.set_aside:
            self.reporter.message(f"warning: {line}")
        if rec.retried:
            self.reporter.message(f"--retry-errors: removed {rec.retried:,} error rows of shard {shard}; "
                                  "their rows are generated again")
        rows = reader.rows(shard, rec.done, self.limit)
        first = next(rows, None)
        if first is None:  # cron's common case: done before loading any model
            self.reporter.start(plan)
            self.reporter.idle()
            self._merge()
            return RunResult("nothing to do", plan, Snapshot(), warnings=reader.warnings,
                             failure=self._failure(rec.errors_here, rec.done_here))
        started = time.monotonic()
        llm = build_engine(self.engine_factory, job)
        self.reporter.message(f"engine ready in {time.monotonic() - started:.1f}s")
        self._check_engine(llm)
        self._warn_context(llm)
        shape = self._task_shape(llm)
        openai = job.spec.output.format == "openai_batch"
        self._text = TextPlan.of(job.spec, not openai and shape is None, llm)
        if openai:
            self._records = ResponseLines(job.model_name, getattr(llm, "tokenizer", None),
                                          job.spec.sampling.logprobs)
        else:
            self._records = SampleRows(shape, self._text.writer_decodes)
        decode = (partial(decode_texts, llm.tokenizer, job.spec.sampling.skip_special_tokens)
                  if self._text.writer_decodes else None)
        writer = PartWriter(
            out_dir, shard, output_schema(job.spec.output.fields, reader.carry_fields, shape,
                                          lora=bool(job.spec.model.lora_modules)),
            job.spec.output.rows_per_part, rec.next_seq,
            {"batchgen.config_hash": job.config_hash, "batchgen.version": __version__,
             "batchgen.model": str(getattr(llm, "model_name", job.spec.model.path)),
             "batchgen.shard": str(shard)}, part_format(job.spec.output.format), guard=lock.check, background=True,
            finish_rows=decode)
        status = "failed"
        snap = Snapshot()
        self.reporter.start(plan)
        try:
            with fewer_collections():
                interrupted = self._loop(llm, itertools.chain([first], rows), writer, snap)
            status = "interrupted" if interrupted else "complete"
        finally:
            writer.shutdown()
            self.reporter.finish(snap, status)
        ignored = ignored_summary(reader.ignored_fields)
        warnings = reader.warnings + ([ignored] if ignored else [])
        for w in warnings:
            if w not in job.warnings:  # those were shown at the start
                self.reporter.message(f"warning: {w}")
        if status == "complete":
            self._merge()
        failure = self._failure(rec.errors_here + snap.errors, rec.done_here + snap.rows)
        return RunResult(status, plan, snap, self.stop.signal_name, warnings, failure if status == "complete" else None)

    def _failure(self, errors: int, rows: int) -> str | None:
        return error_rate_failure(errors, rows, self.max_error_rate, self.shard)

    def _merge(self) -> None:
        """``output.merge_to``: once no row of any shard is missing, the parts as one file."""
        target = self.job.spec.output.merge_to
        if target is None:
            return
        path = self.job.location(target)
        newest = max((p.info.mtime for p in list_parts(self.job.output_dir)), default=0)
        try:
            if path.info().mtime >= newest:
                return
        except FileNotFoundError:
            pass
        try:  # a --limit run's rows are all done when it completes: the input's others are not its own
            merged = merge(self.job.output_dir, path, partial=self.limit is not None)
        except JobError as e:
            self.reporter.message(f"output.merge_to: not written yet: {e}")
            return
        extra = f" (and {merged.extra:,} rows no longer in the input, at the end)" if merged.extra else ""
        self.reporter.message(f"merged {merged.rows:,} rows{extra} into {path}")

    def _warn_context(self, llm: Any) -> None:
        """max_tokens beyond the model's context, for a model validate could not see (fetched by
        the run); said once."""
        spec = self.job.spec
        limit = getattr(llm, "max_model_len", None)
        warning = max_tokens_warning(spec.sampling.max_tokens, limit, spec.model.max_model_len)
        if warning and warning not in self.job.warnings:
            self.reporter.message(f"warning: {warning}")

    def _task_shape(self, llm: Any) -> TaskShape | None:
        """The columns of a task that samples nothing, as this model gives them (None: generate)."""
        spec = self.job.spec
        if spec.task == "generate":
            return None
        embed = spec.embed
        return task_shape(spec.task, llm, token_logprobs=bool(spec.score and spec.score.token_logprobs),
                          pooling=embed and embed.pooling, dimensions=embed and embed.dimensions)

    def _check_engine(self, llm: Any) -> None:
        """Refuses, before any row, a model the job's inputs do not fit: images for a text-only model, chat
        messages for one without a chat template."""
        if self.job.spec.input.images_column and not takes_images(llm):
            raise JobError(f"input.images_column: model {getattr(llm, 'model_name', '?')} takes no images (not a "
                           "vision-language model); use one that does, or remove input.images_column")
        if self.job.spec.input.messages_column is None:
            return
        tok = getattr(llm, "tokenizer", None)
        if tok is not None and not getattr(tok, "chat_template", None):
            raise JobError(f"model {getattr(llm, 'model_name', '?')} has no chat template, so "
                           "input.messages_column cannot be rendered; use input.prompt_column instead")

    # ------------------------------------------------------------------------------------- loop

    def _loop(self, llm: Any, rows: Iterator[Row], writer: PartWriter, snap: Snapshot) -> bool:
        """Run until the input is done or a stop request is served; True if interrupted."""
        start = last_stats = time.monotonic()
        in_flight: dict[str, tuple[PendingRow, int]] = {}
        counter = itertools.count()
        builder = RequestBuilder(self.job.spec, self.job.adapters, detokenize=self._text.engine_decodes)
        self._images = RowImages.for_job(self.job.spec) if takes_images(llm) else None
        images_column = self.job.spec.input.images_column is not None
        memory = image_memory(self.job.spec.input)
        # Reading ahead on a thread pays only where a core is free of the engine's compute: on a CPU engine
        # using every core it took turns with the engine's threads and was ~2% slower (scripts/PERF.md).
        # Images are decoded ahead on that thread whatever the engine: reading and decoding them is slow.
        feeder = RowFeeder(rows, lambda chunk: self._prepare(chunk, builder, getattr(llm, "encode_batch", None)),
                           background=bool(getattr(llm, "spare_core", False)) or images_column,
                           chunk=IMAGE_CHUNK_ROWS if images_column else CHUNK_ROWS, ahead_bytes=memory // 4)
        max_in_flight = self.job.max_in_flight
        self._image_bytes = 0  # of the rows in flight
        exhausted = False
        deadline: float | None = None
        last_flush = start
        try:
            while True:
                now = time.monotonic()
                if self.stop.requested and deadline is None:
                    deadline = now + self.grace
                    self._save(writer, snap)
                    last_flush = now
                    self.reporter.message(
                        f"{self.stop.signal_name or 'stop'} received: admitting no more rows, finishing "
                        f"{len(in_flight)} in-flight requests (at most {self.grace:g}s)")
                if deadline is not None:
                    if not in_flight:
                        break
                    if self.stop.count >= 2 or now >= deadline:
                        self.reporter.message(f"dropping {len(in_flight)} unfinished requests; "
                                              "the next run redoes them")
                        break
                    if writer.pending and now - last_flush >= GRACE_FLUSH_SECONDS:
                        self._save(writer, snap)
                        last_flush = now
                else:
                    if not exhausted and len(in_flight) < max_in_flight and not self.stop.requested:
                        budget = None if not in_flight else max(0, memory - self._image_bytes)
                        for prepared in feeder.take(max_in_flight - len(in_flight), wait=not in_flight,
                                                    max_bytes=budget):
                            self._admit(llm, prepared, next(counter), in_flight, writer, snap)
                        exhausted = feeder.done
                    if not in_flight:
                        if exhausted:
                            break
                        continue
                outputs = llm.step()
                for out in outputs:
                    self._finish(out, in_flight, writer, snap)
                if not outputs and in_flight and not llm.has_unfinished_requests():
                    raise RuntimeError(f"the engine has no unfinished requests but {len(in_flight)} "
                                       "were added and never returned")
                if now - last_stats >= STATS_SECONDS:
                    last_stats = now
                    self._engine_stats(llm, snap)
                    snap.in_flight = len(in_flight)
                    snap.elapsed = now - start
                    snap.parts = writer.parts_written
                    self.reporter.update(snap)
        except BaseException:
            try:
                self._save(writer, snap)
            except Exception as e:  # keep the original error; this one is secondary
                self.reporter.message(f"could not save the finished rows: {e}")
            raise
        else:
            self._save(writer, snap)
        finally:
            feeder.close()
            self._engine_stats(llm, snap)
            snap.in_flight = len(in_flight)
            snap.elapsed = time.monotonic() - start
        return deadline is not None and (bool(in_flight) or not exhausted)

    @staticmethod
    def _save(writer: PartWriter, snap: Snapshot) -> None:
        """Every finished row into a part, written before this returns."""
        writer.flush()
        writer.wait()
        snap.parts = writer.parts_written

    def _prepare(self, rows: list[Row], builder: RequestBuilder,
                 encode_batch: Callable[[list[Any]], list[Any]] | None) -> list[PreparedRow]:
        """The engine requests of each row (or the error it gets instead), their prompts encoded in one
        call when the engine can (``encode_batch``). Runs on the feeder's thread: it only reads the job."""
        prepared = [self._requests_of(row, builder) for row in rows]
        if encode_batch is None:
            return prepared
        requests = [(p, i, request) for p in prepared for i, request in enumerate(p.requests)]
        for (p, i, request), prompt in zip(requests, encode_batch([r.prompt for _, _, r in requests]), strict=True):
            if isinstance(prompt, (ValueError, TypeError)):
                if p.error is None:
                    p.error = self._request_error(p.row, i, len(p.requests), prompt)
            else:
                request.prompt = prompt
        for p in prepared:
            if p.error is not None:
                p.requests = []
        return prepared

    def _requests_of(self, row: Row, builder: RequestBuilder) -> PreparedRow:
        if row.error:
            return PreparedRow(row, error=row.error)
        if row.endpoint == EMBEDDING and not isinstance(self._records, ResponseLines):
            return PreparedRow(row, error=f"{row.where}: field 'url': /v1/embeddings needs output.format "
                                          "openai_batch (this job's columns are a completion's)")
        try:
            requests = builder.for_row(row)
        except RowParamsError as e:
            return PreparedRow(row, error=f"{row.where}: {e}")
        row.top_logprobs = getattr(requests[0].params, "logprobs", None)  # a beam search has none
        row.lora = requests[0].lora.lora_name if requests[0].lora is not None else None
        if not has_images(row):
            return PreparedRow(row, requests)
        if self._images is None:
            return PreparedRow(row, error=f"{row.where}: field {row.prompt_field!r}: model "
                                          f"{self.job.model_name} takes no images (not a vision-language model)")
        try:
            loaded = self._images.prompt(row)
        except ImageError as e:
            return PreparedRow(row, error=str(e))
        finally:
            row.images = []  # the encoded bytes are not needed again
        requests[0].prompt = loaded.prompt  # images come with generate requests, one per row
        return PreparedRow(row, requests, image_bytes=loaded.nbytes)

    def _admit(self, llm: Any, prepared: PreparedRow, n: int, in_flight: dict[str, tuple[PendingRow, int]],
               writer: PartWriter, snap: Snapshot) -> None:
        row, requests = prepared.row, prepared.requests
        if prepared.error is not None:
            self._record_error(row, prepared.error, writer, snap)
            return
        pending = PendingRow(row, [None] * len(requests), prepared.image_bytes)
        added: list[str] = []
        for i, request in enumerate(requests):
            request_id = f"r{n}" if len(requests) == 1 else f"r{n}.{i}"
            extra = {} if request.completion is None else {"completion": request.completion}
            if request.lora is not None:
                extra["lora_request"] = request.lora
            try:
                llm.add_request(request_id, request.prompt, request.params, **extra)
            except (ValueError, TypeError) as e:
                for earlier in added:
                    llm.abort_request(earlier)
                    del in_flight[earlier]
                self._record_error(row, self._request_error(row, i, len(requests), e), writer, snap)
                return
            added.append(request_id)
            in_flight[request_id] = (pending, i)
        self._image_bytes += pending.image_bytes

    def _request_error(self, row: Row, i: int, num_requests: int, error: Exception) -> str:
        """A row's error for its request ``i`` that the engine refused."""
        where = "" if num_requests == 1 else f"input [{i}]: "
        return f"{row.where}: {where}{self._rejection(row, error)}"

    def _rejection(self, row: Row, error: Exception) -> str:
        """Why the engine refused a row, naming the input field when it is about the prompt (or the
        completion a score job scores)."""
        field_name, sep, why = str(error).partition(": ")
        if sep and field_name == "prompt":
            return f"field {row.prompt_field!r}: {why}"
        if sep and field_name == "completion" and self.job.spec.input.completion_column:
            return f"field {self.job.spec.input.completion_column!r}: {why}"
        return f"the engine rejected the request: {error}"

    def _finish(self, out: Any, in_flight: dict[str, tuple[PendingRow, int]], writer: PartWriter,
                snap: Snapshot) -> None:
        """``out``: a RequestOutput, CompletionScore or PoolingRequestOutput."""
        entry = in_flight.pop(out.request_id, None)
        if entry is None:  # not ours, or reported twice
            return
        pending, i = entry
        pending.outputs[i] = out
        if not pending.complete:
            return
        self._image_bytes -= pending.image_bytes
        row, outputs = pending.row, pending.outputs
        for i, done in enumerate(outputs):
            why = done.error or (None if getattr(done, "outputs", True) else "the engine returned no samples")
            if why:
                where = "" if len(outputs) == 1 else f"input [{i}]: "
                self._record_error(row, f"{row.where}: {where}{why}", writer, snap, "generation_failed")
                return
        writer.add(self._records.result(row, outputs))
        snap.rows += 1
        for done in outputs:
            samples = done.outputs if isinstance(done, RequestOutput) else []
            snap.samples += len(samples) or 1
            snap.prompt_tokens += len(done.prompt_token_ids)
            snap.output_tokens += sum(len(c.token_ids) for c in samples)

    def _record_error(self, row: Row, message: str, writer: PartWriter, snap: Snapshot,
                      code: str = "invalid_request") -> None:
        """``code`` is for the OpenAI batch output: the request's fault, or the engine's."""
        writer.add(self._records.error(row, message, code))
        snap.rows += 1
        snap.errors += 1

    @staticmethod
    def _engine_stats(llm: Any, snap: Snapshot) -> None:
        try:
            stats = llm.stats()
        except Exception:  # progress must never kill a run
            return
        snap.kv_cache_usage = stats.get("kv_cache_usage")
        snap.generated_tokens = stats.get("output_tokens")  # as they are made; the engine is this run's
        snap.preemptions = stats.get("num_preemptions")
        snap.running = stats.get("running")
        snap.prefix_cache_hits = stats.get("prefix_cache_hits")
        snap.prefix_cache_queries = stats.get("prefix_cache_queries")
