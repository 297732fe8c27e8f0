"""`tandem bench compare`: order of the runs, prompts, outputs, and a live sweep of both
servers on the tiny model."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tandem.bench import compare
from tandem.bench.datasets import TextMaker
from tandem.frontend.tokenizer import Tokenizer


def test_repeats_alternate_which_server_goes_first():
    servers = [SimpleNamespace(kind="tandem"), SimpleNamespace(kind="mlx_lm")]
    orders = [[s.kind for s in compare.ordered(servers, rep)] for rep in range(4)]
    assert orders == [["tandem", "mlx_lm"], ["mlx_lm", "tandem"]] * 2


def test_every_run_has_at_least_two_requests_per_stream():
    assert [compare.num_prompts(c, 2.0, 8) for c in (1, 4, 16, 64)] == [8, 8, 32, 128]
    assert compare.num_prompts(10, 2.5, 8) == 25


def test_prompts_are_fresh_per_run_and_share_a_fixed_prefix_pool(tiny_model_dir):
    maker = TextMaker(Tokenizer.load(tiny_model_dir("llama")))
    args = SimpleNamespace(input_len=12, output_len=5, prefix_len=40, num_prefixes=3, num_turns=3)
    prompts = compare.Prompts(maker, args)
    a = prompts.specs("random", 6, seed=1)
    assert [s.prompt for s in a] == [s.prompt for s in prompts.specs("random", 6, seed=1)]
    b = prompts.specs("random", 6, seed=2)
    assert not {s.prompt for s in a} & {s.prompt for s in b}
    assert all(s.prompt_len == 12 and s.output_len == 5 for s in a)
    shared = prompts.specs("shared-prefix", 6, seed=3) + prompts.specs("shared-prefix", 6, 4)
    for s in shared:
        assert s.prompt.startswith(prompts.prefixes[s.group])
    assert len({s.prompt for s in shared}) == 12  # suffixes are fresh
    assert sorted({s.group for s in shared}) == [0, 1, 2]
    turns = prompts.specs("multi-turn", 4, seed=5)
    assert all(len(s.turns) == 2 and s.turns[0] != s.turns[1] for s in turns)


def _point(throughputs: list[float]) -> dict:
    runs = [
        {"repeat": i, "output_throughput": t, "ttft_ms": 10.0 + i, "tpot_ms": 2.0, "failed": 0}
        for i, t in enumerate(throughputs)
    ]
    for r in runs:
        r["short_outputs"] = 0
    return compare.point_summary(runs, 8)


def test_table_ratios_and_replot_without_matplotlib(tmp_path, monkeypatch):
    results = {
        "tandem": {"random/c1": _point([100, 300, 200]), "random/c4": _point([400, 400, 400])},
        "mlx_lm": {"random/c1": _point([50, 100, 400]), "random/c4": _point([200, 200, 200])},
    }
    r = compare.ratios(results)
    assert r["random/c1"]["of_medians"] == pytest.approx(200 / 100)
    assert r["random/c1"]["median_paired"] == pytest.approx(2.0)  # of 2.0, 3.0, 0.5
    assert r["random/c4"]["of_medians"] == pytest.approx(2.0)
    table = compare.markdown(results)
    assert "| random/c1 | 200.0 | 100.0 | **2.00** | 11.0 | 11.0 | 2.00 | 2.00 |" in table

    (tmp_path / "results.json").write_text(json.dumps({"results": results}))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails: table only
    assert compare.replot(tmp_path) == 0
    assert (tmp_path / "table.md").read_text() == table
    assert not list(tmp_path.glob("*.png"))

    only = compare.markdown({"tandem": results["tandem"]})
    assert "| random/c4 | tandem | 400.0 | 11.0 | 2.00 |" in only
    assert compare.ratios({"tandem": results["tandem"]}) == {}

    results["mlx_lm"]["random/c4"]["failed"] = 2
    assert compare.markdown(results).endswith(
        "- mlx_lm random/c4: 2 failed, 0 of the wrong length\n"
    )


def _args(tmp_path: Path, model: Path, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    compare.add_arguments(p)
    argv = ["--model", str(model), "--out", str(tmp_path / "out"), "--concurrency", "1,2"]
    argv += ["--repeats", "2", "--input-len", "16", "--output-len", "6"]
    argv += ["--prefix-len", "32", "--num-prefixes", "2"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", v]
    return p.parse_args(argv)


def _servers_left(out: Path) -> list[str]:
    """Processes still running a server command of this run (matched by its port)."""
    commands = json.loads((out / "results.json").read_text())["servers"].values()
    ports = [c["command"].split("--port ")[1].split()[0] for c in commands]
    assert ports
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() for p in ports if f"--port {p} " in line]


def test_live_sweep_alternates_both_servers_and_stops_them(tmp_path, tiny_model_dir):
    args = _args(tmp_path, tiny_model_dir("llama"))
    assert compare.main(args) == 0
    out = tmp_path / "out"
    doc = json.loads((out / "results.json").read_text())
    assert doc["complete"] and set(doc["results"]) == {"tandem", "mlx_lm"}
    assert doc["versions"]["mlx-lm"] and doc["python"] and doc["command"]
    keys = ["random/c1", "random/c2", "shared-prefix/c1", "shared-prefix/c2"]
    for kind in ("tandem", "mlx_lm"):
        assert list(doc["results"][kind]) == keys
        for point in doc["results"][kind].values():
            assert point["failed"] == 0
            # mlx_lm.server has no ignore_eos: the tiny model's EOS may end a few early.
            assert point["short_outputs"] == 0 or kind == "mlx_lm"
            first = 0 if kind == "tandem" else 1
            assert [r["position"] for r in point["runs"]] == [first, 1 - first]
    assert set(doc["ratios"]) == set(keys)
    rows = [r for r in (out / "table.md").read_text().splitlines() if r.startswith("| ")]
    assert len(rows) == 1 + len(keys)
    assert (out / "logs" / "tandem.log").exists() and (out / "logs" / "mlx_lm.log").exists()
    assert not _servers_left(out)


def test_multi_turn_sweep_reports_cached_prompt_share_and_ttft_per_turn(tmp_path, tiny_model_dir):
    args = _args(
        tmp_path,
        tiny_model_dir("llama"),
        datasets="multi-turn",
        num_turns="3",
        concurrency="2",
        input_len="40",
        servers="tandem",
    )
    assert compare.main(args) == 0
    out = tmp_path / "out"
    point = json.loads((out / "results.json").read_text())["results"]["tandem"]["multi-turn/c2"]
    assert point["failed"] == 0
    turns = point["per_turn"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    # Every later turn resends the conversation: most of it comes from the prefix cache.
    assert turns[0]["cached_share"] == 0
    assert all(t["cached_share"] > 0.3 for t in turns[1:]), turns
    assert turns[2]["prompt_tokens"] > turns[1]["prompt_tokens"] > turns[0]["prompt_tokens"]
    table = (out / "table.md").read_text()
    assert "| multi-turn point | turn | prompt tokens | TTFT ms tandem | cached tandem |" in table
    assert table.count("| multi-turn/c2 | ") == 1 + 3  # the main table, then by turn
    assert not _servers_left(out)


def test_a_server_that_fails_to_start_fails_the_run(tmp_path, tiny_model_dir, capsys):
    args = _args(tmp_path, tiny_model_dir("llama"), tandem_args="--no-such-flag 1")
    assert compare.main(args) == 1
    err = capsys.readouterr().err
    assert "tandem server exited" in err and "--no-such-flag" in err  # the log tail
    assert not _servers_left(tmp_path / "out")
