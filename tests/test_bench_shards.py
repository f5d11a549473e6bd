"""scripts/bench_shards.py's smoke run: 100 shards of one job on one bucket, behind the fault proxy, with
random SIGKILLs; the merged output holds every (id, sample) once, and the request report adds up."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_shards.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_shards", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_shards"] = module
    spec.loader.exec_module(module)
    return module


def test_a_hundred_shards_on_one_bucket_with_kills_and_faults(tmp_path, monkeypatch):
    bench = load_bench()
    out = bench.main(["--shards", "100", "--rows-per-shard", "4", "--rows-per-part", "2", "--wave", "4",
                      "--kill-rate", "0.08", "--fault-rate", "0.05", "--json", str(tmp_path / "report.json")])
    assert out["pairs_once"] == 100 * 4 * bench.SAMPLES
    assert out["kills"] >= 1 and out["runs"] >= 100 + out["kills"]  # a killed shard runs again
    assert out["parts"] >= 200 and out["total"] == sum(out["requests"].values())
    assert {"LIST", "GET", "PUT"} <= set(out["requests"]) and 0 < out["lease_requests"] < out["total"]
    assert out["usd_per_1M_rows"] > 0 and (tmp_path / "report.json").exists()
