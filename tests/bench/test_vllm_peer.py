"""vLLM as the peer in bench.compare: how it is started (command line, environment of its best
configuration here), what the sweep and the report say about it, and how a missing install is
told apart. None of this needs vLLM; the one test that starts it skips where `make peers` has
not run (CI)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import bench.compare.systems as systems
from bench.compare.__main__ import choose_systems
from bench.compare.report import headline
from bench.compare.sweep import peer_plan
from bench.compare.systems import SYSTEMS, ServeOptions, serve_settings
from bench.compare.targets import offered
from bench.compare.vllm_peer import VLLM_VENV, libiomp, vllm_env
from bench.loadgen.metrics import SLO, RequestRecord, summarize

REPO = Path(__file__).resolve().parents[2]


def point(system, workload, rate, goodput=1.0, out_tput=10.0) -> dict:
    """A sweep point in results.json form with chosen headline values."""
    records = [RequestRecord(i, "chat", "", 64, 10, 0.0, "ok", ttft_s=0.1, itl_s=(0.01,),
                             e2e_s=0.5, output_tokens=10) for i in range(10)]
    s = summarize(records, wall_s=10.0, slo=SLO()).to_json()
    s["goodput"], s["output_throughput"] = goodput, out_tput
    return {"system": system, "workload": workload, "rate": rate, "summary": s,
            "by_class": {"chat": s}}


@pytest.fixture
def fake_venv(tmp_path, monkeypatch) -> Path:
    """A venv layout with the file the environment names (libiomp5.so), and no vLLM."""
    venv = tmp_path / "vllm"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    (venv / "bin").mkdir()
    (venv / "bin" / "python").write_text("")
    monkeypatch.setattr(systems, "VLLM_VENV", venv)
    return venv


def test_vllm_starts_its_openai_server_module_from_its_own_venv(fake_venv):
    command = SYSTEMS["vllm"].command("/models/smol", 8123, ServeOptions(dtype="bfloat16"))
    assert command[:3] == [str(fake_venv / "bin" / "python"), "-m",
                           "vllm.entrypoints.openai.api_server"]
    args = dict(zip(command[3::2], command[4::2], strict=True))
    assert args == {"--model": "/models/smol", "--dtype": "bfloat16", "--max-model-len": "4096",
                    "--host": "127.0.0.1", "--port": "8123"}


def test_vllm_runs_the_dtype_splitserves_auto_resolves_to_unless_told_otherwise(fake_venv):
    def dtype(opts):
        command = SYSTEMS["vllm"].command("m", 1, opts)
        return command[command.index("--dtype") + 1]

    assert dtype(ServeOptions(dtype="auto", peer_dtype="bfloat16")) == "bfloat16"
    assert dtype(ServeOptions(dtype="bfloat16", peer_dtype="float32")) == "float32"


def test_vllm_binds_every_core_reserves_none_and_preloads_the_venvs_libiomp(fake_venv):
    env = SYSTEMS["vllm"].env(ServeOptions(peer_threads=2))
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                   "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                   "LD_PRELOAD": str(fake_venv / "lib" / "libiomp5.so")}
    assert vllm_env(fake_venv, 1)["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert "OMP_NUM_THREADS" not in env  # vLLM sets its threads from the binding


def test_vllm_max_model_len_is_capped_by_a_model_with_fewer_positions(tmp_path, fake_venv):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    command = SYSTEMS["vllm"].command(str(tmp_path), 1, ServeOptions())
    assert command[command.index("--max-model-len") + 1] == "512"


def test_a_venv_without_libiomp_says_how_to_install_vllm(tmp_path):
    with pytest.raises(RuntimeError, match="make peers"):
        libiomp(tmp_path)


def test_vllm_named_but_not_installed_stops_before_anything_starts(tmp_path, monkeypatch,
                                                                  capsys):
    monkeypatch.setattr(systems, "VLLM_VENV", tmp_path / "absent")
    with pytest.raises(SystemExit, match="vllm is not installed: `make peers` installs it"):
        choose_systems("splitserve-agg,vllm")
    # By default the installed systems run and the missing peer is named.
    assert "vllm" not in choose_systems("")
    assert "vllm: not installed, left out (`make peers` installs it)" in capsys.readouterr().out


def test_vllm_is_chosen_by_default_once_installed(fake_venv):
    # By default: what a user runs, and the peers; an ablation only when named.
    assert choose_systems("") == ("splitserve-disagg", "splitserve-agg", "vllm",
                                  "transformers-serve")
    assert choose_systems("splitserve-agg-nopace") == ("splitserve-agg-nopace",)
    assert choose_systems("splitserve-disagg,splitserve-agg,vllm") == (
        "splitserve-disagg", "splitserve-agg", "vllm")


def test_the_tiny_quick_model_leaves_vllm_out_and_refuses_it_by_name(fake_venv, capsys):
    assert "vllm" not in choose_systems("", tiny_model=True)
    assert "head_dim 8" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--model"):
        choose_systems("vllm", tiny_model=True)


def test_printed_settings_give_vllms_configuration_when_it_runs():
    opts = ServeOptions(dtype="auto", peer_dtype="bfloat16", peer_threads=2)
    text = serve_settings(opts, ("splitserve-disagg", "vllm")).text()
    assert "vLLM" in text and "--dtype bfloat16" in text
    assert "VLLM_CPU_OMP_THREADS_BIND=0-1, VLLM_CPU_NUM_OF_RESERVED_CPU=0" in text
    assert "libiomp5 preloaded" in text and "VLLM_CPU_KVCACHE_SPACE=4 GiB" in text
    assert "transformers serve" not in text
    # splitserve itself runs what ships: the peer's settings are a note, not an override.
    assert "overrides: none" in text
    assert "transformers serve: --dtype bfloat16" in serve_settings(
        opts, ("transformers-serve",)).text()


def test_peer_plan_runs_the_issues_rows_and_nothing_longer():
    plan = peer_plan("m", ("splitserve-disagg", "splitserve-agg", "vllm"))
    by_name = {w.name: w for w in plan.workloads}
    assert set(by_name) == {"burst", "batch1", "long", "chat", "chat-sampled", "shared-prefix"}
    shared = by_name["shared-prefix"].workload
    assert (shared.prefix_groups, shared.prefix_len) == (4, 1024)
    assert by_name["shared-prefix"].rates == (3.0,)
    long = by_name["long"]
    assert long.concurrency == 1 and long.num_requests == 6
    assert "2048" in long.workload.describe()
    burst, batch1, chat = by_name["burst"], by_name["batch1"], by_name["chat"]
    sampled = by_name["chat-sampled"]
    assert sampled.rates == (3.0,) and "top_p=0.95" in sampled.workload.describe()
    assert "transformers-serve" not in sampled.systems  # its flavor takes no sampling fields
    assert burst.burst == 32 and burst.workload.describe() == (
        peer_plan("m").workloads[0].workload.describe())
    assert batch1.concurrency == 1 and batch1.num_requests == 8
    assert "128" in batch1.workload.describe() and "256" in batch1.workload.describe()
    assert chat.rates == (1.0, 3.0) and chat.duration_s == 60.0
    # Every workload is a bounded amount of time per system.
    assert all(w.duration_s <= 120 for w in plan.workloads)


def test_a_closed_loop_point_says_how_many_were_in_flight():
    assert offered({"rate": None, "concurrency": 1}) == "1 at a time"
    assert offered({"rate": None}) == "burst"
    assert offered({"rate": 3.0, "concurrency": None}) == "3 req/s"


def test_headline_compares_both_modes_with_vllm_and_keeps_transformers_as_a_second_peer():
    pts = [point("splitserve-disagg", "burst", None, out_tput=250.0),
           point("splitserve-agg", "burst", None, out_tput=330.0),
           point("vllm", "burst", None, out_tput=330.0),
           point("transformers-serve", "burst", None, out_tput=100.0)]
    itl = {"splitserve-disagg": 0.0263, "splitserve-agg": 0.024, "vllm": 0.024}
    for system, value in itl.items():
        p = point(system, "batch1", None)
        p["concurrency"], p["summary"]["itl_s"]["p50"] = 1, value
        pts.append(p)
    for system, ttft in {"splitserve-disagg": 0.5, "splitserve-agg": 0.45, "vllm": 0.6}.items():
        p = point(system, "long", None)
        p["concurrency"], p["summary"]["ttft_s"]["p50"] = 1, ttft
        pts.append(p)
    for system, (good, share) in {"splitserve-disagg": (0.35, 0.23), "vllm": (2.05, 0.98)}.items():
        p = point(system, "chat", 3.0, goodput=good)
        p["summary"]["goodput_fraction"] = share
        pts.append(p)
    labels = {"splitserve-disagg": "splitserve disaggregated", "splitserve-agg":
              "splitserve aggregated", "transformers-serve": "transformers serve (CB)",
              "vllm": "vLLM (CPU)"}
    results = {"plan": {"slo": {"ttft_s": 1.0, "tpot_s": 0.1}}, "points": pts,
               "systems": {s: {"label": label} for s, label in labels.items()}}
    text = "\n".join(headline(results))
    assert ("| target | splitserve disaggregated | splitserve aggregated | vLLM (CPU) "
            "| transformers serve (CB) | disaggregated / vLLM (CPU) | aggregated / vLLM (CPU) |"
            in text)
    assert "| burst output throughput (tok/s) | 250.0 | 330.0 | 330.0 | 100.0 | 0.76x | 1.00x |" \
        in text
    assert "| batch-1 ITL p50 through HTTP (ms; lower is better) | 26.3 | 24.0 | 24.0 | - " \
        "| 1.10x | 1.00x |" in text
    assert "| 2048-token prompt alone: TTFT p50 through HTTP (ms; lower is better) | 500 | 450 " \
        "| 600 | - | 0.83x | 0.75x |" in text
    assert "chat at 3 req/s: share meeting TTFT <= 1 s and TPOT <= 100 ms (goodput) " \
        "| 23% (0.35 req/s" in text and "| 98% (2.05 req/s" in text and "| 0.17x | n/a |" in text
    assert "interference" not in text  # no such points: no such table


SMOLLM2 = REPO / "models" / "smollm2-135m-instruct"


@pytest.mark.slow
@pytest.mark.skipif(not (VLLM_VENV / ".installed").exists() or not SMOLLM2.exists(),
                    reason="vLLM is not installed here (make peers; CI does not) or no SmolLM2")
def test_quick_compare_runs_against_a_real_vllm(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.compare", "--quick", "--model", str(SMOLLM2),
         "--systems", "vllm", "--workloads", "burst", "--out", str(out), "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    info = results["systems"]["vllm"]
    assert "error" not in info and info["version"] != "absent"
    assert "VLLM_CPU_OMP_THREADS_BIND=" in info["command"]
    [burst] = results["points"]
    s = burst["summary"]
    assert s["completed"] == s["requests"] == 16
    assert s["inexact_outputs"] == 0  # ignore_eos honoured: every output exactly as long as asked
