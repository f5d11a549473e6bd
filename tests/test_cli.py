"""The command line itself: --version and -h, a help that lists every command whole, usage lines and
options a reader understands (no `{job}`, no `<float range>`, help text for every option), each
command pointing to its guide, and command-line mistakes exiting 2."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import typer
from jobkit import FAKE, REPO, cli, run, setup_job

from batchgen import __version__, guides
from batchgen.cli import GUIDES, app
from batchgen.job.errors import EXIT_ERROR

COMMANDS = ["run", "ray", "run-batch", "merge", "validate", "status", "slurm", "eval", "docs"]


def _commands() -> dict[str, Any]:
    """The click commands typer makes (of typer's own copy of click)."""
    return dict(typer.main.get_command(app).commands)


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings."""
    headings = re.findall(r"^#+ (.+)$", markdown, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_version_and_help_exit_0():
    r = cli("--version")
    assert r.exit_code == 0 and r.stdout == f"batchgen {__version__}\n"
    for flag in ("-h", "--help"):
        r = cli(flag)
        assert r.exit_code == 0, r.output
        assert "..." not in r.stdout.split("Commands:")[1]  # no command's line is cut short
        for name, command in _commands().items():
            assert re.search(rf"^  {re.escape(name)} +{re.escape(command.short_help.split()[0])}", r.stdout, re.M)
            assert " ".join(command.short_help.split()) in " ".join(r.stdout.split()), name
    assert set(_commands()) == set(COMMANDS)


@pytest.mark.parametrize("name", [c for c in COMMANDS if c != "eval"])  # eval passes -h on to lm-eval's own help
def test_each_command_has_a_plain_usage_help_for_every_option_and_its_guide(name):
    r = cli(name, "-h")
    assert r.exit_code == 0, r.output
    usage = r.stdout.splitlines()[0]
    assert usage.startswith("Usage: ") and not re.search(r"[{}<>]", usage), usage
    assert not re.search(r"<(float|int|str|text|path)[^>]*>", r.stdout.split("Options:")[1]), r.stdout
    for param in _commands()[name].params:
        if getattr(param, "hidden", False):
            continue
        assert param.help, f"{name} {param.opts[0]} has no help text"
        if param.param_type_name == "option" and not param.is_flag:
            assert param.metavar, f"{name} {param.opts[0]} shows its type instead of what it takes"
    page, _, anchor = GUIDES[name].partition("#")
    assert f"Guide: {GUIDES[name]} (batchgen docs {Path(page).stem})" in r.stdout
    assert (REPO / page).is_file(), GUIDES[name]
    assert not anchor or anchor in _anchors((REPO / page).read_text(encoding="utf-8")), GUIDES[name]


def test_a_bad_shard_is_a_command_line_error(tmp_path):
    job = setup_job(tmp_path, rows=3)
    for shard in ("5/4", "1-4", "0/0"):
        r = run(job, "--shard", shard)
        assert r.exit_code == 2, (shard, r.output)
        assert "Invalid value for '--shard'" in r.stderr and "Traceback" not in r.output
    assert not (tmp_path / "out").exists()


def test_status_takes_the_job_file_too(tmp_path):
    job = setup_job(tmp_path, rows=6)
    r = cli("status", job)
    assert r.exit_code == 1 and r.stderr.splitlines() == [
        f"batchgen: error: no such output dir: {tmp_path / 'out'} (output.dir of {job}); "
        "no run of this job has started"]
    assert run(job, "--engine", FAKE).exit_code == 0
    by_dir, by_job = cli("status", tmp_path / "out"), cli("status", job)
    assert by_job.exit_code == 0 and by_job.stdout == by_dir.stdout
    assert re.search(r"^total\s+1\s+6\s+0\s+0$", by_job.stdout, re.M), by_job.stdout


def test_status_json_for_scripts(tmp_path):
    job = setup_job(tmp_path, rows=6)
    assert run(job, "--shard", "0/2").exit_code == 0
    r = cli("status", tmp_path / "out", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["schema"] == 1 and report["output_dir"] == str(tmp_path / "out")
    assert report["shard_count"] == 2 and [s["shard"] for s in report["shards"]] == ["0/2", "1/2"]
    first, second = report["shards"]
    assert first["state"] == "done" and first["missing"] == 0 and first["rows"] == first["input_rows"]
    assert second["state"] == "not started" and second["rows"] == 0 and second["missing"] == second["input_rows"]
    total = {"parts": first["parts"], "rows": first["rows"], "errors": 0, "missing": second["missing"]}
    assert report["total"] == total
    assert (report["duplicates"], report["input_error"], report["written_twice"]) == (0, None, 0)
    assert json.loads(cli("status", tmp_path / "out", "--json", "--no-input").stdout)["total"]["missing"] is None
    missing = cli("status", tmp_path / "nowhere", "--json")
    assert missing.exit_code == 1 and missing.stdout == "" and "no such output dir" in missing.stderr


def test_validate_json_for_scripts(tmp_path):
    job = setup_job(tmp_path, rows=3)
    ok = cli("validate", job, "--json", "--engine", FAKE)
    assert ok.exit_code == 0 and json.loads(ok.stdout) == {
        "schema": 1, "job": str(job), "ok": True, "problems": [], "warnings": []}
    bad = setup_job(tmp_path, name="bad.yaml", sampling={"top_p": 5, "max_token": 3})
    r = cli("validate", bad, "--json", "--engine", FAKE)
    assert r.exit_code == 1 and r.stderr == ""
    result = json.loads(r.stdout)
    assert result["ok"] is False
    assert {p["field"] for p in result["problems"]} == {"sampling.top_p", "sampling.max_token"}
    assert any("did you mean 'max_tokens'" in p["message"] for p in result["problems"])
    gone = cli("validate", tmp_path / "gone.yaml", "--json")
    assert gone.exit_code == 1 and json.loads(gone.stdout)["problems"] == [
        {"field": "", "message": f"job file not found: {tmp_path / 'gone.yaml'}"}]


def test_docs_lists_the_guides_and_prints_one(tmp_path, monkeypatch):
    listed = cli("docs")
    assert listed.exit_code == 0
    assert re.search(r"^cli +The command line$", listed.stdout, re.M)
    assert re.search(r"^readme +batchgen$", listed.stdout, re.M) and "troubleshooting" in listed.stdout
    assert cli("docs", "cli").stdout == (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    assert cli("docs", "Buckets.md").stdout.startswith("# Buckets")
    wrong = cli("docs", "clii")
    assert wrong.exit_code == 1 and wrong.stderr == (
        "batchgen: error: no guide 'clii' (did you mean 'cli'?); `batchgen docs` lists them\n")
    assert "batchgen docs lists them" in cli("-h").stdout
    shipped = tmp_path / "docs"  # an installed wheel's copy (setup.py's build_py) wins over a clone's
    shipped.mkdir()
    (shipped / "cli.md").write_text("# The command line, shipped\n")
    monkeypatch.setattr(guides, "PACKAGED", shipped)
    assert cli("docs").stdout == "cli                  The command line, shipped\n"
    assert cli("docs", "cli").stdout == "# The command line, shipped\n"


def test_status_merge_and_help_start_without_torch(tmp_path):
    """The job commands that read output files only (status, merge, --help) never import torch: on a login
    node `batchgen status` answers in well under a second, and a test's every `batchgen` process starts
    ~1.5 s sooner. The engine's names load on first use (batchgen/engine/__init__.py)."""
    import subprocess
    import sys

    job = setup_job(tmp_path, rows=4, output={"format": "jsonl"})
    assert run(job).exit_code == 0
    out = tmp_path / "out"
    probe = ("import sys; from batchgen.cli import app\n"
             "for args in (['status', sys.argv[1]], ['merge', sys.argv[1], '-o', sys.argv[2]], ['--help']):\n"
             "    try:\n        app(args=args)\n"
             "    except SystemExit as e:\n        assert not e.code, (args, e.code)\n"
             "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe, str(out), str(tmp_path / "all.jsonl")], capture_output=True,
                          text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "all.jsonl").read_text().count("\n") == 4 * 2  # sampling.n
    assert done.stdout.strip().splitlines()[-1] == "False", done.stdout + done.stderr


def test_the_command_leaves_without_finalizing_native_threads(tmp_path):
    """A daemon thread inside C++ when the interpreter finalizes (Arrow's and the tokenizer's pools, here a
    torch matmul) aborts the process: "terminate called without an active exception", exit -6, where a run
    interrupted after saving its rows owes the scheduler exit 75. The command leaves with os._exit once it is
    over; the same process exiting the usual way aborts (the control: the hazard is real here)."""
    import subprocess
    import sys

    probe = ("import sys, threading, torch\n"
             "a = torch.randn(1024, 1024)\n"
             "busy = threading.Event()\n"
             "def work():\n    busy.set()\n    while True:\n        torch.mm(a, a)\n"
             "threading.Thread(target=work, daemon=True).start()\n"
             "busy.wait()\n"
             "if sys.argv[1] == 'command':\n"
             "    from batchgen.cli import main\n"
             "    sys.argv = ['batchgen', 'validate', sys.argv[2]]\n"
             "    main()\n")
    job = tmp_path / "job.yaml"
    job.write_text("model: {path: /nowhere}\n")  # invalid: the command's own exit code must come through
    plain = subprocess.run([sys.executable, "-c", probe, "plain"], capture_output=True, text=True, cwd=REPO)
    assert plain.returncode == -6 and "terminate called" in plain.stderr, (plain.returncode, plain.stderr)
    done = subprocess.run([sys.executable, "-c", probe, "command", str(job)], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == EXIT_ERROR and "terminate" not in done.stderr, (done.returncode, done.stderr)
    assert "job.yaml" in done.stderr
