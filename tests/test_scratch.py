"""Scratch files in the temp dir: named after their host and process, and a run removes those of this host's
processes that are gone (a killed run's part copy), never a live process's nor another host's."""

from __future__ import annotations

import os
import subprocess
import sys

from jobkit import FAKE, batchgen_cmd, setup_job, subprocess_env

from batchgen.storage import scratch


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_gone_process_entries_are_swept_and_the_living_kept(tmp_path, monkeypatch):
    host = scratch._host()
    dead = _dead_pid()
    orphan_file = tmp_path / f".batchgen-upload-{host}-{dead}-abc.upload"
    orphan_dir = tmp_path / f".batchgen-index-{host}-{dead}-xyz"
    live = tmp_path / f".batchgen-upload-{host}-{os.getpid()}-def.upload"
    elsewhere = tmp_path / f".batchgen-upload-otherhost-{dead}-ghi.upload"
    unrelated = tmp_path / f"batchgen-notes-{dead}.txt"
    orphan_file.write_bytes(b"x" * 1000)
    orphan_dir.mkdir()
    (orphan_dir / "index.arrow").write_bytes(b"y")
    for path in (live, elsewhere, unrelated):
        path.write_text("keep")
    assert scratch.sweep_orphans(tmp_path) == 2
    assert not orphan_file.exists() and not orphan_dir.exists()
    assert live.exists() and elsewhere.exists() and unrelated.exists()
    assert scratch.sweep_orphans(tmp_path) == 0


def test_scratch_names_carry_host_and_pid(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    made = scratch.scratch_file("upload", suffix=".upload")
    assert made.name.startswith(f".batchgen-upload-{scratch._host()}-{os.getpid()}-") and made.parent == tmp_path
    with scratch.scratch_dir("ids") as name:
        assert os.path.basename(name).startswith(f".batchgen-ids-{scratch._host()}-{os.getpid()}-")


def test_a_run_removes_what_a_killed_run_left_in_the_temp_dir(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    left = temp / f".batchgen-upload-{scratch._host()}-{_dead_pid()}-q1.upload"
    left.write_bytes(b"a part's copy")
    job = setup_job(tmp_path, rows=3)
    done = subprocess.run(batchgen_cmd("run", job, "--engine", FAKE), env=subprocess_env(TMPDIR=str(temp)),
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert not left.exists()
    assert f"removed 1 scratch file(s) that killed runs left in {temp}" in done.stdout + done.stderr
