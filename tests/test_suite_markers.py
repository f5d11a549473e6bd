"""The suite's own markers: every test on the real SmolLM2 is marked `slow`, so a quick local run
(`-m "not slow"`) leaves them out, while CI (`scripts/test.sh`, no `-m`) runs them all."""

from __future__ import annotations

import subprocess
import sys

from jobkit import REPO, TESTS_DIR

# The files with tests on the real model.
REAL_MODEL_FILES = ["test_smollm2.py", "test_beam_search.py", "test_structured.py", "test_reproducibility.py",
                    "test_job_structured.py"]


def _collected(*args: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args,
                           *(str(TESTS_DIR / f) for f in REAL_MODEL_FILES)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 5), proc.stdout + proc.stderr  # 5: nothing collected
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_not_slow_leaves_out_every_real_model_test():
    slow, quick = _collected("-m", "slow"), _collected("-m", "not slow")
    assert slow and quick
    uses_the_real_model = {"smollm2", "readme_structured_outputs_example"}
    assert all(any(word in test.lower() for word in uses_the_real_model) for test in slow), slow
    assert not [test for test in quick if "smollm2" in test.lower()], quick
    assert len(slow) >= 9  # test_smollm2 (5), beams, structured, reproducibility (2), the README's structured job
    ci = (REPO / ".ci" / "run").read_text() + (REPO / "scripts" / "test.sh").read_text()
    assert "scripts/test.sh" in ci and "slow" not in ci  # CI deselects nothing
