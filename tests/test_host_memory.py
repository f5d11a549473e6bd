import platform
import subprocess
import sys
import textwrap

import pytest

from batchgen.ops.host_memory import retain_freed_memory

on_glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                              reason="glibc settings")


@on_glibc
def test_retain_freed_memory_applies_on_glibc():
    assert retain_freed_memory()
    assert retain_freed_memory()  # idempotent


@on_glibc
def test_release_freed_memory_hands_the_retained_heap_back():
    """Blocks freed under the retain settings stay in RSS until release_freed_memory (run in a fresh
    process: the settings are process-wide)."""
    script = textwrap.dedent("""
        import psutil, torch
        from batchgen.ops.host_memory import release_freed_memory, retain_freed_memory
        assert retain_freed_memory()
        rss = lambda: psutil.Process().memory_info().rss >> 20
        blocks = [torch.ones(2 << 20) for _ in range(40)]  # 8 MiB each: on the heap, under the threshold
        before = rss()
        del blocks
        kept = rss()
        assert release_freed_memory()
        print(before, kept, rss())
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    before, kept, released = map(int, result.stdout.split())
    assert kept > before - 100  # retained: freeing 320 MiB gave nothing back
    assert released < kept - 250  # released


def test_fewer_collections_raises_the_young_threshold_and_restores_the_callers():
    import gc

    from batchgen.engine.gc_pacing import YOUNG_THRESHOLD, fewer_collections

    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        with fewer_collections():
            assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
        assert gc.get_threshold() == (700, 10, 10)
        gc.set_threshold(0, 10, 10)  # the caller turned collection off: it stays off
        with fewer_collections():
            assert gc.get_threshold()[0] == 0
        gc.set_threshold(700, 10, 10)
        with pytest.raises(RuntimeError), fewer_collections():
            raise RuntimeError("a failed loop restores the thresholds too")
        assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*before)


def _record_young_threshold(monkeypatch, cls) -> list[int]:
    """Wraps cls.step so that each call records the collector's first threshold at that moment."""
    import gc

    seen: list[int] = []
    step = cls.step

    def recording(self):
        seen.append(gc.get_threshold()[0])
        return step(self)

    monkeypatch.setattr(cls, "step", recording)
    return seen


def test_generate_and_the_job_loop_step_under_fewer_collections(tiny_model_dirs, tmp_path, monkeypatch):
    import gc

    import fake_llm
    from jobkit import run, setup_job

    from batchgen import LLM, SamplingParams
    from batchgen.engine.gc_pacing import YOUNG_THRESHOLD

    before = gc.get_threshold()
    seen = _record_young_threshold(monkeypatch, LLM)
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", kv_cache_memory="8MiB")
    llm.generate([[5, 6, 7]] * 3, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert seen and set(seen) == {max(before[0], YOUNG_THRESHOLD)} and gc.get_threshold() == before

    seen = _record_young_threshold(monkeypatch, fake_llm.FakeLLM)
    result = run(setup_job(tmp_path, rows=12))
    assert result.exit_code == 0, result.output
    assert seen and set(seen) == {max(before[0], YOUNG_THRESHOLD)} and gc.get_threshold() == before
