"""The engine benchmarks' own tools run and report what they claim: the step profiler's
phases add up to the step, and the plain-loop ceiling decodes the greedy tokens mlx-lm does."""

from __future__ import annotations

from mlx_lm.utils import load

from tandem.bench import ceiling, step_profile
from tests.parity.test_mlx_lm_parity import reference


def test_step_profile_phases_add_up_and_count_graph_nodes(tiny_model_dir):
    path = tiny_model_dir("llama")
    for overlap in (False, True):
        r = step_profile.profile(path, 4, 16, 12, overlap, count_nodes=not overlap)
        assert r["steady_steps"] >= 8
        parts = sum(r[k] for k in ("schedule", "build", "submit", "wait", "update", "other"))
        # Medians of parts need not sum to the median step exactly; they are close.
        assert 0.5 * r["step"] < parts < 2 * r["step"]
        assert r["tok_s"] > 0
        assert (r.get("nodes", 0) > 50) == (not overlap)


def test_plain_loop_ceiling_decodes_mlx_lms_greedy_tokens(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompts = [[5 + (7 * i + j) % 300 for j in range(16)] for i in range(3)]
    tokens, _ = ceiling.plain_decode(load(str(path))[0], prompts, 10)
    for p, t in zip(prompts, tokens, strict=True):
        assert t == reference(path, p, 10)
    assert ceiling.plain_loop(path, 2, 16, 8, 1, 400, prefill=True) > 0


def test_every_report_entry_is_a_valid_bench_command(tmp_path) -> None:
    """`tandem bench report`'s lists parse as the bench commands they run (a renamed flag
    would otherwise surface only on the device), and the summary renders their JSON."""
    import json

    from tandem.bench import report
    from tandem.cli import build_parser

    parser = build_parser()
    for machine, entries in report.PROFILES.items():
        assert len({e.name for e in entries}) == len(entries), machine
        for entry in entries:
            argv = report.command(entry, tmp_path)[3:]  # after python -m tandem.cli
            args = parser.parse_args(argv)
            assert args.json == str(tmp_path / f"{entry.name}.json")
    offline = {
        "single": {
            "mlx_lm_tok_s": 100.0,
            "tandem_tok_s": 130.0,
            "ratio_vs_mlx_lm": 1.3,
            "ceiling_tok_s": 140.0,
            "of_ceiling": 0.93,
            "overlap_on_off": 1.2,
        },
        "batch_16": {"mlx_lm_tok_s": 800.0, "tandem_tok_s": 1200.0, "ratio_vs_mlx_lm": 1.5},
        "batch_64": {
            "mlx_lm_error": "RuntimeError: cudaMallocAsync failed: out of memory",
            "tandem_tok_s": 4000.0,
            "ceiling_error": "RuntimeError: something else",
        },
    }
    spec = {
        "rows": [
            {
                "workload": "random",
                "streams": 1,
                "spec_tokens": 0,
                "tok_s": 50.0,
                "ratio": 1.0,
                "acceptance": None,
                "mean_accepted_per_verify": None,
                "exact": True,
            },
            {
                "workload": "random",
                "streams": 1,
                "spec_tokens": 4,
                "tok_s": 90.0,
                "ratio": 1.8,
                "acceptance": 0.7,
                "mean_accepted_per_verify": 2.8,
                "backoffs": 0,
                "exact": True,
            },
        ]
    }
    (tmp_path / "offline-tiny.json").write_text(json.dumps(offline))
    (tmp_path / "spec-ngram.json").write_text(json.dumps(spec))
    text = report.render("cpu", tmp_path)
    assert "| single stream | 100.0 | 130.0 | **1.30** | 140.0 | 0.93 | 1.20 |" in text
    assert "| B = 16 | 800.0 | 1,200.0 | **1.50** |" in text
    assert "| B = 64 | out of memory | 4,000.0 |  | failed |" in text
    assert "| random | 1 | 4 | 90.0 | **1.80** | 70% | 2.80 | 0 | yes |" in text
    assert "(not run)" in text  # the entries without JSON
    assert "tandem bench offline --shape tiny" in text
    # rendered elsewhere, the header is the machine the entries ran on
    env = {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-12-05", "versions": {"mlx": "9.9"}}
    env["tandem"] = {"git_commit": "0123456789abcdef", "dirty": False}
    (tmp_path / "environment.json").write_text(json.dumps(env))
    text = report.render("cpu", tmp_path)
    assert "Commit `0123456789ab`, 2026-12-05; NVIDIA H100 80GB HBM3" in text
    assert "Versions: mlx 9.9" in text


def test_a_ceiling_that_fails_is_recorded_not_fatal(monkeypatch) -> None:
    """Out of memory in the plain loop (an 80 GB card) leaves the row's other numbers and
    says why the ceiling is missing."""
    from tandem.bench import offline

    def oom(*a, **k):
        raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")

    monkeypatch.setattr(offline, "plain_loop", oom)
    row = {"tandem_tok_s": 10.0}
    offline._ceiling(row, "path", 1, 8, 8, 1, 100, prefill=True)
    error = "RuntimeError: cudaMallocAsync(&data, size, stream) failed: out of memory"
    assert row == {"tandem_tok_s": 10.0, "ceiling_error": error}
