"""The engine benchmarks' own tools run and report what they claim: the step profiler's
phases add up to the step, and the plain-loop ceiling decodes the greedy tokens mlx-lm does."""

from __future__ import annotations

import pytest
from mlx_lm.utils import load

from tandem.bench import ceiling, ramp, step_profile
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
        # What the timed run launched: mostly the 4 single-token rows (12 steps of 4x4).
        assert r["plans"].get("4x4", 0) >= 8 and sum(r["plans"].values()) >= 12
        assert (r["chained"] > 0) == overlap and r["threaded"] == 0


def test_step_profile_with_the_host_thread_forced_on(tiny_model_dir):
    """host_thread=True: the timed steps run their host work on the loop's helper (counted),
    and steady steps are still found by their plans."""
    r = step_profile.profile(
        tiny_model_dir("llama"), 4, 16, 12, True, options={"host_thread": True}
    )
    assert r["threaded"] >= 8 and r["steady_steps"] >= 8 and r["tok_s"] > 0


def test_ramp_splits_a_run_into_prefill_and_decode_steps(tiny_model_dir):
    """4 prompts of 24 tokens with a 32-token step budget: the ramp takes at least 2 loop
    steps (96 prompt tokens; a loop step that starts the chain launches two), every prompt
    token is counted once, and the run goes on in steps of the 4 decode rows alone."""
    r = ramp._tandem(tiny_model_dir("llama"), 4, 24, 10, 400, 32, {})
    steps = r["steps"]
    assert sum(s["prefill_tokens"] for s in steps) == 4 * 24
    assert all(s["prefill_tokens"] <= 2 * 32 for s in steps)
    assert 2 <= r["ramp_steps"] < len(steps)
    assert sum(s["decode_rows"] == 4 and not s["prefill_tokens"] for s in steps) >= 5
    assert r["decode_steps"] + r["ramp_steps"] == len(steps)
    assert abs(r["ramp_s"] + r["decode_s"] - sum(s["ms"] for s in steps) / 1e3) < 1e-9


def test_plain_loop_ceiling_decodes_mlx_lms_greedy_tokens(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompts = [[5 + (7 * i + j) % 300 for j in range(16)] for i in range(3)]
    tokens, _ = ceiling.plain_decode(load(str(path))[0], prompts, 10)
    for p, t in zip(prompts, tokens, strict=True):
        assert t == reference(path, p, 10)
    run = ceiling.side(path, 8, prefill=True)()
    assert run(prompts[:2]) > 0 and run(prompts[0]) > 0  # a batch, or one prompt


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
    # An entry rerun alone (--only) at another commit: the others keep the one they ran at.
    (tmp_path / "environment.json").write_text(json.dumps(env))
    later = report._environment(tmp_path, {"offline-tiny", "spec-ngram", "offline-smollm2"})
    assert later["entry_commits"] == {"offline-tiny": "0123456789ab", "spec-ngram": "0123456789ab"}
    later["entry_commits"]["spec-ngram"] = "fedcba987654"
    (tmp_path / "environment.json").write_text(
        json.dumps({**env, "entry_commits": later["entry_commits"]})
    )
    text = report.render("cpu", tmp_path)
    assert "Commits per table (the latest run at `0123456789ab`)" in text
    assert "At `0123456789ab`." in text and "At `fedcba987654`." in text


def test_a_ceiling_that_fails_is_recorded_not_fatal() -> None:
    """Out of memory in the plain loop (an 80 GB card) leaves the row's other numbers and
    says why the ceiling is missing; a ceiling that ran gives Tandem's share of it."""
    from tandem.bench import offline

    error = "RuntimeError: cudaMallocAsync(&data, size, stream) failed: out of memory"

    def side(rate: float, fail: bool = False):
        def load():
            def run(x: int) -> float:
                if fail:
                    raise RuntimeError(error.split(": ", 1)[1])
                return rate

            return run

        return load

    loaders = {"mlx_lm_tok_s": side(5.0), "tandem_tok_s": side(10.0)}
    for interleave in (True, False):
        row = offline._measured({**loaders, "ceiling_tok_s": side(0, True)}, [1, 2], interleave)
        assert row == {
            "mlx_lm_tok_s": 5.0,
            "tandem_tok_s": 10.0,
            "ratio_vs_mlx_lm": 2.0,
            "ceiling_error": error,
        }
        saved: list[dict] = []
        with_ceiling = {**loaders, "ceiling_tok_s": side(12.5)}
        row = offline._measured(with_ceiling, [1, 2], interleave, saved.append)
        assert row["ceiling_tok_s"] == 12.5 and row["of_ceiling"] == 0.8
        # The row as it grew: after each side's phase, or each round of turns.
        assert saved[-1] == row
        if not interleave:
            assert saved[0] == {"mlx_lm_tok_s": 5.0} and len(saved) == 3


def _sides(log: list[str], fail: dict[str, str] | None = None):
    """Fake sides: each run logs (side, input) and rates the input itself; ``fail`` makes a
    side raise at "load" or at an input."""
    fail = fail or {}

    def loader(name: str):
        def load():
            log.append(f"load {name}")
            if fail.get(name) == "load":
                raise RuntimeError(f"{name} failed to load")

            def run(x: int) -> float:
                log.append(f"{name} {x}")
                if fail.get(name) == str(x):
                    raise RuntimeError(f"{name} failed at {x}")
                return float(x)

            return run

        return load

    return {name: loader(name) for name in ("a", "b")}


@pytest.mark.parametrize("interleave", [True, False])
def test_sides_are_taken_in_turn_or_phase_by_phase(interleave) -> None:
    """Interleaved: every side is loaded, then the inputs go round the sides in turn;
    phase by phase: one side's load and runs, then the next's. The first input only warms
    each side up."""
    from tandem.bench import sides

    log: list[str] = []
    rates, errors = sides.measure(_sides(log), [100, 1, 2, 6], interleave=interleave)
    assert rates == {"a": 2.0, "b": 2.0} and errors == {}
    if interleave:  # (the order rotates from one input to the next)
        assert log == [
            *("load a", "a 100", "load b", "b 100"),
            *("a 1", "b 1", "b 2", "a 2", "a 6", "b 6"),
        ]
    else:
        assert log == [
            "load a",
            "a 100",
            "a 1",
            "a 2",
            "a 6",
            "load b",
            "b 100",
            "b 1",
            "b 2",
            "b 6",
        ]


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("when", ["load", "100", "2"])
def test_an_optional_side_that_fails_is_recorded_and_the_rest_go_on(interleave, when) -> None:
    from tandem.bench import sides

    log: list[str] = []
    loaders = _sides(log, {"a": when})
    rates, errors = sides.measure(
        loaders, [100, 1, 2, 6], interleave=interleave, optional=frozenset({"a"})
    )
    assert rates == {"b": 2.0}
    assert errors == {
        "a": f"RuntimeError: a failed {'to load' if when == 'load' else 'at ' + when}"
    }
    assert "a 6" not in log and "b 6" in log
    with pytest.raises(RuntimeError, match="a failed"):
        sides.measure(_sides([], {"a": when}), [100, 1, 2, 6], interleave=interleave)


def test_batched_prompt_sets_are_distinct() -> None:
    """No run repeats another's prompts: Tandem's prefix cache must not serve a timed run
    from the warm-up's (mlx-lm has no cache to hit)."""
    from tandem.bench import sides

    sets = sides.prompt_sets(16, 4, 16, 64, 512)
    assert len(sets) == 4 and all(len(s) == 16 and all(len(p) == 64 for p in s) for s in sets)
    firsts = [tuple(p[:16]) for s in sets for p in s]
    assert len(set(firsts)) == len(firsts)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("fail", [None, "load", "100", "2"])
def test_no_side_outlives_its_measurement(interleave, fail) -> None:
    """Every side's model (here a stand-in object its run holds) is gone when ``measure``
    returns, and in phase mode before the next side loads its own copy."""
    import weakref

    from tandem.bench import sides

    alive: dict[str, weakref.ref] = {}
    at_load: list[list[str]] = []

    class Model:
        pass

    def loader(name: str):
        def load():
            at_load.append([n for n, r in alive.items() if r() is not None])
            model = Model()
            alive[name] = weakref.ref(model)

            def run(x: int) -> float:
                if name == "a" and fail == str(x):
                    raise RuntimeError("failed")
                return float(x) + 0 * id(model)

            if name == "a" and fail == "load":
                raise RuntimeError("failed")
            return run

        return load

    loaders = {n: loader(n) for n in ("a", "b")}
    sides.measure(loaders, [100, 1, 2, 6], interleave=interleave, optional=frozenset({"a"}))
    assert all(r() is None for r in alive.values())
    if not interleave:
        assert at_load == [[], []]


def test_sides_interleave_on_a_gpu_only_where_every_copy_fits(tmp_path, monkeypatch):
    import mlx.core as mx

    from tandem.bench import offline

    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    for total, fits in ((16_000, True), (15_999, False), (None, False)):
        info = {"architecture": "x"} if total is None else {"memory_size": total}
        monkeypatch.setattr(mx, "device_info", lambda info=info: info)
        assert offline._fits(tmp_path, 4) is fits
        assert offline._fits(tmp_path, 3) is (total is not None)
